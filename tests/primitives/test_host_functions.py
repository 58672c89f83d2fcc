"""The FAILED-bit rule (``design/errors.md``, "A failing callback") in every
specialised host function ``host_functions.host_function`` builds: the same
failure cases run against each, called as XLA calls them (NumPy operands,
the carrier first, the partition id last for per-device ones)."""
import jax
import numpy as np
import pytest

from jax_effects._primitives import host_callback as _host_callback
from jax_effects._primitives import host_functions as _host_functions
from jax_effects._runtime import errors as _errors
from jax_effects._runtime import placement as _placement

SLOT = 4321   # a slot no thread of this process has: errors are deferred
FAILED = int(_errors.FAILED)
I32 = jax.core.ShapedArray((), np.int32)
F32_2 = jax.core.ShapedArray((2,), np.float32)
HERE = _placement.Placement(0, None, 0)
TABLE = (_placement.Placement(0, 0, 0), _placement.Placement(1, 1, 0))


class Boom(Exception):
  pass


def _specialisations():
  """name -> (host_function kwargs, carrier aval, operands, partition id?,
  result avals)."""
  return {
      # _threaded_once, its one-operand no-result fast form
      "once_one_operand": (_placement.Where(HERE, None), I32,
                           (np.float32(3),), False, ()),
      # _threaded_once, the general form (two operands and a result)
      "once_with_result": (_placement.Where(HERE, None), I32,
                           (np.float32(3), np.float32(4)), False, (F32_2,)),
      # _threaded_per_device
      "per_device": (_placement.Where(None, TABLE), I32,
                     (np.float32(3),), True, (F32_2,)),
      # _general: a carrier with one element per device
      "general_vector_carrier": (_placement.Where(HERE, None),
                                 jax.core.ShapedArray((2,), np.int32),
                                 (np.float32(3),), False, (F32_2,)),
  }


def _build(name, entry, fn):
  where, carrier_aval, operands, per_device, result_avals = (
      _specialisations()[name])
  cb = _host_callback.HostCallback(fn, f"test effect {name}",
                                   tuple(result_avals))
  host = _host_functions.host_function(
      cb, where, passthrough=1, threaded=True,
      avals_out=(carrier_aval, *result_avals), entry=entry)
  def call(carrier):
    extra = (np.uint32(1),) if per_device else ()
    return host(carrier, *operands, *extra)
  carrier = np.full(carrier_aval.shape, SLOT, np.int32)
  return call, carrier, operands, result_avals


def _results(result_avals):
  return tuple(np.ones(a.shape, a.dtype) for a in result_avals)


@pytest.fixture(autouse=True)
def _no_deferred_left():
  yield
  _errors.pop_deferred((SLOT,))


@pytest.mark.parametrize("name", sorted(_specialisations()))
@pytest.mark.parametrize("entry", [False, True])
def test_runs_and_passes_the_carrier_through(name, entry):
  calls = []
  def fn(*args):
    calls.append(args)
    return _results(result_avals)
  call, carrier, operands, result_avals = _build(name, entry, fn)
  out = call(carrier)
  assert len(calls) == 1 and all(
      np.array_equal(a, b) for a, b in zip(calls[0], operands))
  np.testing.assert_array_equal(out[0], carrier)
  for r, a in zip(out[1:], result_avals):
    np.testing.assert_array_equal(r, np.ones(a.shape, a.dtype))
  assert not _errors.has_deferred(SLOT)


@pytest.mark.parametrize("name", sorted(_specialisations()))
def test_failed_carrier_skips_the_effect(name):
  calls = []
  def fn(*args):
    calls.append(args)
    return _results(result_avals)
  call, carrier, _, result_avals = _build(name, False, fn)
  failed = np.bitwise_or(carrier, np.int32(FAILED))
  out = call(failed)
  assert calls == []                                   # skipped
  np.testing.assert_array_equal(out[0], failed)        # as received
  for r, a in zip(out[1:], result_avals):
    np.testing.assert_array_equal(r, np.zeros(a.shape, a.dtype))


@pytest.mark.parametrize("name", sorted(_specialisations()))
def test_failed_bit_at_the_chain_entry_is_an_earlier_executions(name):
  calls = []
  def fn(*args):
    calls.append(args)
    return _results(result_avals)
  call, carrier, _, result_avals = _build(name, True, fn)
  out = call(np.bitwise_or(carrier, np.int32(FAILED)))
  assert len(calls) == 1                               # runs
  np.testing.assert_array_equal(out[0], carrier)       # bit cleared


@pytest.mark.parametrize("name", sorted(_specialisations()))
@pytest.mark.parametrize("entry", [False, True])
def test_exception_is_deferred_to_the_carriers_slot(name, entry):
  def fn(*args):
    raise Boom(name)
  call, carrier, _, result_avals = _build(name, entry, fn)
  out = call(carrier)
  np.testing.assert_array_equal(out[0],
                                np.bitwise_or(carrier, np.int32(FAILED)))
  for r, a in zip(out[1:], result_avals):
    np.testing.assert_array_equal(r, np.zeros(a.shape, a.dtype))
  exc = _errors.pop_deferred((SLOT,))
  assert isinstance(exc, Boom) and str(exc) == name     # once, as itself
  assert _errors.pop_deferred((SLOT,)) is None


@pytest.mark.parametrize("name", sorted(_specialisations()))
def test_wrong_results_are_deferred_like_an_exception(name):
  *_, result_avals = _specialisations()[name]
  if not result_avals:
    pytest.skip("no results declared")
  call, carrier, _, _ = _build(name, False, lambda *a: (np.zeros(7),))
  out = call(carrier)
  assert int(np.max(out[0])) & FAILED
  exc = _errors.pop_deferred((SLOT,))
  assert isinstance(exc, TypeError) and f"test effect {name}" in str(exc)
