"""The ``jax.extend`` names jax_effects uses, without importing ``jax.extend``.

``jax.extend.core``, ``jax.extend.core.primitives``,
``jax.extend.source_info_util`` and ``jax.extend.mlir.dialects.stablehlo``
re-export these objects from the modules they are taken from here (the same
on JAX 0.8-0.12). Importing any module under ``jax.extend`` runs
``jax/extend/__init__.py``, which imports ``jax.extend.pallas`` (JAX
0.10-0.12): about 22-25 ms of the 52-57 ms ``import jax_effects`` took
after ``import jax`` (0.10.2 and 0.12.0.1, medians of 8-12 processes; now
28-32 ms), and on JAX 0.11 on Pallas defines configuration states that
enter every ``jax.jit`` call's key (``include_in_jit_key``), which every
call of the user's own ``jax.jit`` functions then reads (bench row (p),
``p_import``: a plain step's time after / before the import read 1.010 on
0.12.0.1 against 0.998 in processes importing nothing, means of six
runs, where 0.10.2 read the same with and without).
``tests/api/test_versions.py`` checks that importing and using
jax_effects loads neither.

Part in the token calling convention: none; the objects the other layers
build it from.
"""
from __future__ import annotations

import types

# Jaxprs, their variables and primitives. JAX 0.11 on has one jaxpr class
# (``ClosedJaxpr`` an alias of ``Jaxpr`` on 0.11, absent from
# ``jax._src.core`` on 0.12, where ``jax.extend.core.ClosedJaxpr`` is
# ``Jaxpr``).
from jax._src import core as _core
from jax._src.core import Jaxpr, Literal, Primitive, Var, jaxpr_as_fun
from jax._src.core import jaxprs_in_params

ClosedJaxpr = getattr(_core, "ClosedJaxpr", Jaxpr)

# The higher-order primitives the pass threads through
# (``jax.extend.core.primitives``' sources, JAX 0.8-0.12).
from jax._src.ad_checkpoint import remat_p  # noqa: E402
from jax._src.custom_derivatives import custom_jvp_call_p  # noqa: E402
from jax._src.custom_derivatives import custom_vjp_call_p  # noqa: E402
from jax._src.lax.control_flow import cond_p  # noqa: E402
from jax._src.lax.control_flow import linear_solve_p  # noqa: E402
from jax._src.lax.control_flow import scan_p  # noqa: E402
from jax._src.lax.control_flow import while_p  # noqa: E402
from jax._src.pjit import jit_p  # noqa: E402

primitives = types.SimpleNamespace(
    call_p=_core.call_p, closed_call_p=_core.closed_call_p, cond_p=cond_p,
    custom_jvp_call_p=custom_jvp_call_p, custom_vjp_call_p=custom_vjp_call_p,
    jit_p=jit_p, linear_solve_p=linear_solve_p, remat_p=remat_p,
    scan_p=scan_p, while_p=while_p)

# Call sites (``jax.extend.source_info_util``'s source, JAX 0.8-0.12).
from jax._src import source_info_util  # noqa: E402,F401

# StableHLO's Python dialect (``jax.extend.mlir.dialects.stablehlo`` is
# ``jaxlib``'s, which ``jax._src.lib.mlir.dialects`` imports as ``hlo``,
# JAX 0.8-0.12).
from jax._src.lib.mlir.dialects import hlo  # noqa: E402,F401

__all__ = ["ClosedJaxpr", "Jaxpr", "Literal", "Primitive", "Var",
           "jaxpr_as_fun", "jaxprs_in_params", "primitives",
           "source_info_util", "hlo"]
