"""jax_effects.log: logging records from compiled code, with device attribution."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_effects as je

N = 8


@pytest.fixture
def info(caplog):
  caplog.set_level(logging.INFO, logger="jax_effects")
  return caplog


def test_record_fields_in_single_device_jit(info, effects_capture):
  f = je.jit(lambda x: (je.log("x={} y={y}", x, y=x * 2), x)[1])
  f(jax.device_put(jnp.int32(4), jax.devices()[3]))
  (rec,) = effects_capture.logged
  assert rec.name == "jax_effects"
  assert rec.levelno == logging.INFO
  assert rec.getMessage() == "x=4 y=8"
  assert (rec.device_id, rec.shard_index, rec.process_index) == (3, None, 0)
  assert rec.pathname == __file__ and rec.funcName == "<lambda>"
  assert [r.getMessage() for r in info.records] == ["x=4 y=8"]


def test_device_id_follows_the_computation(info, effects_capture):
  f = je.jit(lambda x: (je.log("v={}", x), x)[1])
  for d in (5, 0, 7):
    f(jax.device_put(jnp.int32(d), jax.devices()[d]))
  assert [(r.device_id, r.getMessage()) for r in effects_capture.logged] == [
      (5, "v=5"), (0, "v=0"), (7, "v=7")]


def test_logger_name_logger_object_and_level(caplog, effects_capture):
  caplog.set_level(logging.DEBUG, logger="my.app")
  lg = logging.getLogger("my.app")

  def f(x):
    je.log("by name {}", x, logger="my.app", level="WARNING")
    je.log("by object {}", x, logger=lg, level=logging.DEBUG)
    return x

  je.jit(f)(jnp.int32(1))
  recs = effects_capture.logged
  assert [(r.name, r.levelname, r.getMessage()) for r in recs] == [
      ("my.app", "WARNING", "by name 1"), ("my.app", "DEBUG", "by object 1")]


def test_disabled_level_emits_nothing(caplog, effects_capture):
  caplog.set_level(logging.WARNING, logger="jax_effects")
  f = je.jit(lambda x: (je.log("quiet {}", x, level=logging.DEBUG),
                        je.log("loud {}", x, level=logging.ERROR), x)[2])
  f(jnp.int32(2))
  assert [r.getMessage() for r in effects_capture.logged] == ["loud 2"]


def test_order_with_print_matches_eager(info, effects_capture):
  def f(x):
    for i in range(3):
      je.print("p{} {}", i, x + i)
      je.log("l{} {}", i, x - i)
    return x

  je.jit(f)(jnp.int32(10))
  jitted = [("p", l) for l in effects_capture.printed]
  logged = [r.getMessage() for r in effects_capture.logged]
  effects_capture.clear()
  with jax.disable_jit():
    f(jnp.int32(10))
  assert effects_capture.printed == [l for _, l in jitted]
  assert [r.getMessage() for r in effects_capture.logged] == logged
  assert logged == ["l0 10", "l1 9", "l2 8"]


def test_eager_record_has_no_device(info, effects_capture):
  je.log("eager {}", np.float32(1.5))
  (rec,) = effects_capture.logged
  assert (rec.getMessage(), rec.device_id, rec.shard_index,
          rec.process_index) == ("eager 1.5", None, None, 0)


def test_per_device_records_in_shard_map(info, effects_capture, mesh):
  f = je.jit(jax.shard_map(lambda x: (je.log("s {}", x[0]), x)[1], mesh=mesh,
                           in_specs=P("i"), out_specs=P("i")))
  f(jnp.arange(N, dtype=jnp.int32) * 3)
  recs = sorted(effects_capture.logged, key=lambda r: r.device_id)
  assert [(r.device_id, r.shard_index, r.process_index, r.getMessage())
          for r in recs] == [(d, d, 0, f"s {3 * d}") for d in range(N)]


def test_sharded_jit_record_is_not_per_device(info, effects_capture, mesh):
  x = jax.device_put(jnp.arange(N), NamedSharding(mesh, P("i")))
  je.jit(lambda x: (je.log("sum {}", x.sum()), x)[1])(x)
  (rec,) = effects_capture.logged
  assert (rec.device_id, rec.shard_index, rec.getMessage()) == (
      0, None, f"sum {sum(range(N))}")


def test_formatter_can_use_the_attributes(info, effects_capture):
  fmt = logging.Formatter("%(device_id)s/%(shard_index)s/%(process_index)s "
                          "%(message)s")
  je.jit(lambda x: (je.log("m {}", x), x)[1])(
      jax.device_put(jnp.int32(1), jax.devices()[6]))
  (rec,) = effects_capture.logged
  assert fmt.format(rec) == "6/None/0 m 1"


def test_bad_arguments_fail_at_trace_time_naming_them():
  f = je.jit(lambda x: (je.log("{} {}", x), x)[1])
  with pytest.raises(ValueError, match=r"jax_effects.log\('\{\} \{\}'\)"):
    f(jnp.int32(1))
  with pytest.raises(TypeError, match="logger= must be"):
    je.jit(lambda x: (je.log("{}", x, logger=3), x)[1])(jnp.int32(1))
  with pytest.raises(ValueError, match="unknown level name 'LOUD'"):
    je.jit(lambda x: (je.log("{}", x, level="LOUD"), x)[1])(jnp.int32(1))
  with pytest.raises(TypeError, match=r"argument #0 is a NumPy array of dtype "
                                      r"object .*not an array of numbers"):
    je.log("{}", np.array([object()]))


def test_placement_inside_a_handler_calling_jitted_code(effects_capture):
  # A log record's handler runs inside the log's host callback (on device 3);
  # jitted code it calls runs its own callback (on device 0), where
  # je.placement() is that callback's, and back in the handler the log's.
  seen = []
  def record(v):
    seen.append(("inner", je.placement()))
    return v

  # (its result is the callback's: waiting for it waits for the callback;
  # a barrier is refused inside a callback)
  inner = je.jit(lambda x: je.callback(
      record, jax.ShapeDtypeStruct((), jnp.int32), x))

  class Handler(logging.Handler):
    def emit(self, record):
      seen.append(("handler", je.placement()))
      jax.block_until_ready(inner(jnp.int32(0)))
      seen.append(("handler", je.placement()))

  logger = logging.getLogger("jax_effects.test_nested_handler")
  logger.setLevel(logging.INFO)
  logger.propagate = False
  handler = Handler()
  logger.addHandler(handler)
  try:
    outer = je.jit(lambda x: (je.log("x={}", x, logger=logger), x)[1])
    outer(jax.device_put(jnp.int32(4), jax.devices()[3]))
    je.effects_barrier()
  finally:
    logger.removeHandler(handler)
  assert [(w, p.device_id, p.shard_index) for w, p in seen] == [
      ("handler", 3, None), ("inner", 0, None), ("handler", 3, None)]
  assert je.placement() is None
