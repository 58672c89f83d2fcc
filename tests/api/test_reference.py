"""``docs/reference.md`` documents every public name, with the signature the
package has (the public API, re-exported flat by ``jax_effects/__init__.py``:
``design/architecture.md``, "The tree is the layers").

Each name of ``jax_effects.__all__`` has a ``## `name` `` entry whose first
``python`` block is its signature as ``inspect.signature`` gives it
(annotations as written in the source, without quotes) or, for a constant,
``name: Type``. Members are ``### `Owner.member` `` entries (``Owner(...)``:
a member of what the public function ``Owner`` returns), checked the same
way; every public member of a public class (and of a progress bar) has one.
"""
import inspect
import pathlib
import re

import pytest

import jax_effects as je
from jax_effects._dispatch.function import PjitFunction
from jax_effects._frontends.progress import Progress

REFERENCE = pathlib.Path(__file__).parents[2] / "docs" / "reference.md"
#: What ``Owner(...)`` stands for in a member heading.
RESULTS = {"jit": PjitFunction, "progress": Progress}


def entries():
  """Heading (the text between backquotes) -> first code block after it."""
  text = REFERENCE.read_text()
  found = {}
  for m in re.finditer(r"^(##|###) `([^`]+)`\n(.*?)(?=^##|\Z)", text,
                       re.S | re.M):
    block = re.search(r"```python\n(.*?)\n```", m[3], re.S)
    found[m[2]] = block[1] if block else None
  return found


def signature_text(name, obj):
  return name + str(inspect.signature(obj)).replace("'", "")


def member_text(owner, member):
  """The documented form of ``owner.member``: a signature for a method,
  ``name: annotation`` for a property or an annotated attribute."""
  value = inspect.getattr_static(owner, member, None)
  if isinstance(value, property):
    return f"{member}: {value.fget.__annotations__['return']}"
  if inspect.isfunction(value):
    return signature_text(member, value)
  for klass in owner.__mro__:
    if member in vars(klass).get("__annotations__", {}):
      return f"{member}: {vars(klass)['__annotations__'][member]}"
  raise AssertionError(f"{owner.__name__}.{member}: nothing to document")


def expected(heading):
  if "." not in heading:
    obj = getattr(je, heading)
    if inspect.isclass(obj) or callable(obj):
      return signature_text(heading, obj)
    return f"{heading}: {type(obj).__name__}"
  owner_name, member = heading.rsplit(".", 1)
  if owner_name.endswith("(...)"):
    owner = RESULTS[owner_name[:-len("(...)")]]
  else:
    owner = getattr(je, owner_name)
  return member_text(owner, member)


def test_every_public_name_has_an_entry():
  documented = {h for h in entries() if "." not in h}
  assert sorted(set(je.__all__) - documented) == []
  assert sorted(documented - set(je.__all__)) == []   # none left over


def public_members(cls):
  return {m for m in vars(cls) if not m.startswith("_")}


@pytest.mark.parametrize("owner", ["Effect", "Placement", "RuntimeTokens",
                                   "progress(...)"])
def test_every_public_member_has_an_entry(owner):
  cls = (RESULTS[owner[:-5]] if owner.endswith("(...)")
         else getattr(je, owner))
  members = public_members(cls) | {
      m for m in vars(cls).get("__annotations__", {}) if not m.startswith("_")}
  documented = {h.rsplit(".", 1)[1] for h in entries()
                if h.startswith(owner + ".")}
  assert sorted(members - documented) == []


@pytest.mark.parametrize("heading", sorted(entries()))
def test_documented_signature_is_the_package_s(heading):
  assert entries()[heading] == expected(heading)


def test_readme_and_reference_explain_several_processes():
  # (issue 49: neither said what a jax.distributed program prints where;
  # tests/tools/test_multiprocess.py checks what they say: a once-effect in
  # process 0 only, per-device effects in each process for its devices)
  readme = " ".join((REFERENCE.parents[1] / "README.md").read_text().split())
  section = readme.split("### Several processes (`jax.distributed`)", 1)
  assert len(section) == 2, "README: no section on several processes"
  text = section[1].split("###", 1)[0]
  for said in ("jax.distributed.initialize()",
               "so each process runs it for its own devices",
               "only process 0 prints it",
               "`jfx.effects_barrier()` waits for this process's effects only",
               "sync_global_devices",
               "python -m jax_effects demo --processes 2"):
    assert said in text, said
  reference = " ".join(REFERENCE.read_text().split())
  section = reference.split("## Several processes (`jax.distributed`)", 1)
  assert len(section) == 2, "reference: no section on several processes"
  text = section[1].split("## `", 1)[0]
  assert "only process 0 runs it" in text
  assert "in each process for its local devices" in text
