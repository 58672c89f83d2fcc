"""``jax_effects.log``: a ``logging`` record from compiled code, made as
``logging.Logger.log`` makes it, with the device it came from.

Contract: ``design/formatting.md``, "Logging". Records carry
``device_id``/``shard_index``/``process_index`` (the placement of the
effect, ``design/placement.md``), reach the logger's handlers in program
order with ``print``, and honour the logger's level. Differential where
possible: the same call through ``logging`` itself, on the same source
line, must give a record with the same location (``stacklevel``), message,
``extra`` attributes, ``exc_info``, ``stack_info`` and adapter processing.
"""
import io
import json
import logging
import sys

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


# --- records from compiled code, with their device -------------------------

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


# --- as logging.Logger.log: differential with logging itself --------------

@pytest.fixture
def std():
  """A logger whose records (those of logging itself) are collected."""
  lg = logging.getLogger("test_logging.std")
  records = []

  class Collect(logging.Handler):
    def emit(self, record):
      records.append(record)

  h = Collect(level=logging.DEBUG)
  lg.addHandler(h)
  lg.setLevel(logging.DEBUG)
  lg.propagate = False
  yield lg, records
  lg.removeHandler(h)
  lg.setLevel(logging.NOTSET)
  lg.propagate = True


def _where(rec):
  return (rec.pathname, rec.lineno, rec.funcName)


RUNNERS = [pytest.param(lambda f: f, id="eager"),
           pytest.param(lambda f: je.jit(f), id="jit")]


# --- source location and stacklevel ------------------------------------------------

def helper(lg, msg, x, stacklevel):
  # A logging helper: stacklevel=2 makes records point at the helper's caller.
  je.log(msg, x, logger=lg, stacklevel=stacklevel); lg.info(msg, stacklevel=stacklevel)  # noqa: E702


def outer_helper(lg, msg, x, stacklevel):
  helper(lg, msg, x, stacklevel)


@pytest.mark.parametrize("run", RUNNERS)
@pytest.mark.parametrize("stacklevel", [0, 1, 2, 3, 4, 10, 10_000])
def test_location_honours_stacklevel_like_logging(std, run, stacklevel,
                                                  effects_capture, request):
  lg, records = std

  def user_function(x):
    outer_helper(lg, "m {}", x, stacklevel)
    return x

  run(user_function)(jnp.int32(1))
  (ours,) = effects_capture.logged
  theirs = records[0]  # logging's own record, made at trace time
  if stacklevel <= 3:
    if stacklevel >= 1:  # logging points stacklevel=0 into itself; we don't
      assert _where(ours) == _where(theirs)
    assert ours.funcName == {0: "helper", 1: "helper", 2: "outer_helper",
                             3: "user_function"}[stacklevel]
  elif request.node.callspec.id.endswith("eager"):
    assert _where(ours) == _where(theirs)  # no jax frames in between
  else:
    # Under jit, jax's tracing frames do not count (logging counts them):
    # stacklevel=4 is the caller of the jitted function.
    jax_dir = jax.__file__.rsplit("/", 1)[0]
    assert not ours.pathname.startswith(jax_dir)
    if stacklevel == 4:
      assert ours.funcName == "test_location_honours_stacklevel_like_logging"


@pytest.mark.parametrize("run", RUNNERS)
def test_location_is_the_call_site(run, std, effects_capture):
  lg, records = std

  def f(x):
    je.log("a {}", x, logger=lg); lg.info("a")  # noqa: E702
    return x

  run(f)(jnp.int32(1))
  (ours,) = effects_capture.logged
  assert _where(ours) == _where(records[0])
  assert ours.funcName == "f"


def test_stacklevel_must_be_an_int():
  with pytest.raises(TypeError, match=r"jax_effects.log\('x'\): stacklevel= "
                                      r"must be an int"):
    je.log("x", stacklevel="2")


@pytest.mark.parametrize("run", RUNNERS)
def test_stack_info_like_logging(run, std, effects_capture):
  lg, records = std

  def f(x):
    je.log("s {}", x, logger=lg, stack_info=True); lg.info("s", stack_info=True)  # noqa: E702
    return x

  run(f)(jnp.int32(1))
  (ours,) = effects_capture.logged
  theirs = records[0]
  assert ours.stack_info.startswith("Stack (most recent call last):\n")
  # The same stack up to the calling line (logging's own frames excluded).
  assert ours.stack_info.splitlines()[:-1] == theirs.stack_info.splitlines()[:-1]
  assert f"line {ours.lineno}, in f" in ours.stack_info.splitlines()[-2]
  assert logging.Formatter().format(ours).endswith(ours.stack_info)


# --- exc_info -------------------------------------------------------------------

@pytest.mark.parametrize("run", RUNNERS)
@pytest.mark.parametrize("how", ["true", "instance", "tuple"])
def test_exc_info_like_logging(run, how, std, effects_capture):
  lg, records = std
  err = KeyError("missing")

  def f(x):
    try:
      raise err
    except KeyError as e:
      arg = {"true": True, "instance": e, "tuple": sys.exc_info()}[how]
      je.log("failed {}", x, logger=lg, exc_info=arg, level=logging.ERROR)
      lg.error("failed", exc_info=arg)
    return x

  run(f)(jnp.int32(3))
  (ours,) = effects_capture.logged
  theirs = records[0]
  assert ours.exc_info[0] is KeyError and ours.exc_info[1] is err
  assert ours.exc_info == theirs.exc_info
  text = logging.Formatter().format(ours)
  assert text.startswith("failed 3\nTraceback (most recent call last):")
  assert text.endswith("KeyError: 'missing'")


def test_exc_info_outside_except_is_none(effects_capture):
  je.log("no error", exc_info=True)
  (rec,) = effects_capture.logged
  assert rec.exc_info == (None, None, None)  # as logging records it


# --- extra -------------------------------------------------------------------------

@pytest.mark.parametrize("run", RUNNERS)
def test_extra_sets_record_attributes(run, std, effects_capture):
  lg, records = std

  def f(x):
    je.log("e {}", x, logger=lg, extra={"request": "r-1", "step": x * 2,
                                         "tags": ("a", x)})
    return x

  run(f)(jnp.int32(4))
  (rec,) = effects_capture.logged
  assert rec.request == "r-1"
  assert rec.step == 8 and isinstance(rec.step, np.int32)
  assert rec.tags[0] == "a" and rec.tags[1] == 4
  fmt = logging.Formatter("%(request)s %(step)d %(message)s")
  assert fmt.format(rec) == "r-1 8 e 4"
  assert records[0].getMessage() == "e 4"  # the logger's handler got it


class JsonFormatter(logging.Formatter):
  """What python-json-logger and structlog's stdlib bridge do: the record's
  own attributes (those ``extra`` added, and ours) with the message, through
  ``json.dumps`` with no ``default=``. A value JSON cannot take (a NumPy
  scalar) makes the handler drop the record (``Handler.handleError``)."""

  STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__)

  def format(self, record):
    fields = {k: v for k, v in record.__dict__.items()
              if k not in self.STANDARD}
    return json.dumps({"message": record.getMessage(), **fields})


EXTRA = {"run_id": 7, "lr": 0.1, "warm": True, "seen": 12345678901,
         "name_": "exp-1", "none": None, "shape": (2, 3),
         "tags": ["a", 1.5]}
JSON_EXTRA = {**EXTRA, "shape": [2, 3]}   # (what JSON makes of the tuple)


@pytest.fixture
def json_lines(monkeypatch):
  """A logger with a JSON handler; yields (logger, lines it wrote). A
  record the handler drops reports on stderr (``logging.raiseExceptions``),
  and its line is missing."""
  lg = logging.getLogger("test_logging.json")
  out = io.StringIO()
  handler = logging.StreamHandler(out)
  handler.setFormatter(JsonFormatter())
  lg.addHandler(handler)
  lg.setLevel(logging.INFO)
  lg.propagate = False
  yield lg, lambda: [json.loads(line) for line in out.getvalue().splitlines()]
  lg.removeHandler(handler)
  lg.setLevel(logging.NOTSET)
  lg.propagate = True


def _json_program(lg, where):
  def one(x):
    je.log("loss {:.2f}", x, logger=lg, extra=EXTRA)
    return x

  if where == "scan":
    return lambda xs: jax.lax.scan(lambda c, x: (c, one(x)), 0, xs)[1]
  if where == "vmap":
    return jax.vmap(one)
  return lambda xs: [one(x) for x in xs]


@pytest.mark.parametrize("where", ["loop", "scan", "vmap"])
@pytest.mark.parametrize("run", RUNNERS)
def test_extra_keeps_python_values_for_a_json_handler(json_lines, run, where,
                                                      capsys):
  """Issue 29: ``extra`` is kept as ``Logger.log`` keeps it (7 an int, 0.1 a
  float, True a bool, 12345678901 whole), so a JSON handler formats every
  record; only traced values become arrays."""
  lg, lines = json_lines
  f = run(_json_program(lg, where))
  f(jnp.array([0.5, 0.25, 0.125]))
  je.effects_barrier()
  assert "Logging error" not in capsys.readouterr().err
  got = lines()
  assert [r["message"] for r in got] == ["loss 0.50", "loss 0.25", "loss 0.12"]
  for r in got:
    assert {k: r[k] for k in JSON_EXTRA} == JSON_EXTRA
    for k in JSON_EXTRA:   # (json.loads gives 7 for 7.0: types too)
      assert type(r[k]) is type(JSON_EXTRA[k]), (k, r[k])
    assert r["process_index"] == 0


@pytest.mark.parametrize("run", RUNNERS)
def test_extra_values_are_the_objects_given_traced_ones_numpy(run, std,
                                                              effects_capture):
  lg, records = std
  token = object()
  plain_array = np.arange(3)

  def f(x):
    je.log("m", logger=lg, extra={"obj": token, "np": plain_array,
                                  "traced": x * 2, "mixed": {"k": 3, "v": x}})
    lg.info("m", extra={"obj": token, "np": plain_array})
    return x

  run(f)(jnp.int32(4))
  (ours,) = effects_capture.logged
  assert ours.obj is token and ours.np is plain_array   # as logging keeps them
  assert records[-1].obj is token and records[-1].np is plain_array
  assert ours.traced == 8 and isinstance(ours.traced, np.int32)
  assert ours.mixed["k"] == 3 and type(ours.mixed["k"]) is int
  assert ours.mixed["v"] == 4 and isinstance(ours.mixed["v"], np.int32)


@pytest.mark.parametrize("key", ["message", "asctime", "msg", "lineno",
                                 "device_id", "shard_index", "process_index"])
def test_extra_may_not_overwrite_record_attributes(key):
  with pytest.raises(ValueError, match=rf"extra= sets '{key}'"):
    je.jit(lambda x: je.log("{}", x, extra={key: 1}))(jnp.int32(1))


def test_extra_must_be_a_mapping():
  with pytest.raises(TypeError, match=r"extra= must be a mapping"):
    je.log("x", extra=[("a", 1)])


def test_format_keyword_named_like_a_logging_option_is_the_option():
  with pytest.raises(ValueError, match=r"refers to keyword argument 'extra'"):
    je.log("{extra}", extra={"a": 1})


# --- logger adapters -----------------------------------------------------------------

class Prefix(logging.LoggerAdapter):
  def process(self, msg, kwargs):
    kwargs["extra"] = {**self.extra, **(kwargs.get("extra") or {})}
    return f"[{self.extra['request']}] {msg}", kwargs


@pytest.mark.parametrize("run", RUNNERS)
@pytest.mark.parametrize("kind", ["plain", "custom", "nested"])
def test_logger_adapter_like_logging(run, kind, std, effects_capture):
  lg, records = std
  adapter = {"plain": lambda: logging.LoggerAdapter(lg, {"request": "q7"}),
             "custom": lambda: Prefix(lg, {"request": "q7"}),
             "nested": lambda: Prefix(Prefix(lg, {"request": "in"}),
                                      {"request": "out"})}[kind]()

  def f(x):
    je.log("v {}", x, logger=adapter, extra={"user": "u"}); adapter.info("v 5", extra={"user": "u"})  # noqa: E702
    return x

  run(f)(jnp.int32(5))
  (ours,) = effects_capture.logged
  theirs = records[0]
  assert ours.getMessage() == theirs.getMessage()
  assert ours.name == theirs.name == lg.name
  assert ours.request == theirs.request
  assert getattr(ours, "user", None) == getattr(theirs, "user", None)
  assert _where(ours) == _where(theirs)
  fmt = logging.Formatter("%(request)s|%(message)s")
  assert fmt.format(ours) == fmt.format(theirs)


def test_adapter_process_runs_when_the_record_is_emitted(std, effects_capture):
  lg, _ = std
  calls = []

  class Counting(logging.LoggerAdapter):
    def process(self, msg, kwargs):
      calls.append(msg)
      return msg, kwargs

  f = je.jit(lambda x: je.log("n {}", x, logger=Counting(lg, {})))
  f(1)
  f(2)
  assert calls == ["n 1", "n 2"]
  assert [r.getMessage() for r in effects_capture.logged] == ["n 1", "n 2"]


def test_logger_type_is_checked():
  with pytest.raises(TypeError, match=r"logger= must be None, a logger name "
                                      r"\(str\), a logging.Logger or a "
                                      r"logging.LoggerAdapter, got int"):
    je.log("x", logger=3)


def test_placement_attributes_stay(std, effects_capture):
  lg, _ = std
  f = je.jit(lambda x: je.log("p {}", x, logger=lg, extra={"k": 1}))
  f(jax.device_put(jnp.int32(1), jax.devices()[2]))
  je.log("eager", logger=logging.LoggerAdapter(lg, {"a": 1}))
  recs = effects_capture.logged
  assert [(r.device_id, r.shard_index, r.process_index) for r in recs] == [
      (2, None, 0), (None, None, 0)]
  assert recs[0].k == 1 and recs[1].a == 1
