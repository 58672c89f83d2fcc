"""effects_capture.logged without logging configuration
(``design/formatting.md``, "Capture in tests").

The fixture captures every jax_effects.log record of any level, without the
test configuring logging; ``effects_capture.set_level`` changes that; a
level set explicitly on a logger decides for it; handlers still see only
what the logger enables.
"""
import logging
import textwrap

import jax.numpy as jnp
import pytest

import jax_effects as je

pytest_plugins = ["pytester"]


@pytest.fixture
def unconfigured():
  """The loggers used here, with no level of their own (as in a fresh process)."""
  names = ["jax_effects", "app", "app.sub", "other"]
  saved = {n: logging.getLogger(n).level for n in names}
  for n in names:
    logging.getLogger(n).setLevel(logging.NOTSET)
  root_level = logging.root.level
  logging.root.setLevel(logging.WARNING)
  yield
  for n, level in saved.items():
    logging.getLogger(n).setLevel(level)
  logging.root.setLevel(root_level)


def _emit_all(x):
  for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
    je.log("{} {}", logging.getLevelName(level), x, level=level)
    je.log("{} {}", logging.getLevelName(level), x, level=level, logger="app.sub")
    je.log("{} {}", logging.getLevelName(level), x, level=level, logger="other")
  return x


def _seen(cap):
  return [(r.name, r.levelname) for r in cap.logged]


ALL = [(n, lv) for lv in ("DEBUG", "INFO", "WARNING", "ERROR")
       for n in ("jax_effects", "app.sub", "other")]


@pytest.mark.parametrize("jit", [False, True])
def test_every_level_is_captured_without_configuration(unconfigured, jit,
                                                       effects_capture):
  (je.jit(_emit_all) if jit else _emit_all)(jnp.int32(1))
  assert _seen(effects_capture) == ALL
  rec = effects_capture.logged[1]
  assert rec.getMessage() == "DEBUG 1" and rec.name == "app.sub"


def test_readme_info_example_is_captured(unconfigured, effects_capture):
  @je.jit
  def step(x):
    je.log("sum = {}", x.sum(), level=logging.INFO)
    return x

  step(jnp.arange(3.0))
  assert [r.getMessage() for r in effects_capture.logged] == ["sum = 3.0"]


def test_handlers_see_only_enabled_records(unconfigured, effects_capture,
                                           caplog):
  # caplog's handler sits on the root: logging itself decides what reaches it.
  je.jit(_emit_all)(jnp.int32(2))
  assert len(effects_capture.logged) == 12
  assert [(r.name, r.levelname) for r in caplog.records] == [
      (n, lv) for n, lv in ALL if lv in ("WARNING", "ERROR")]


def test_set_level_for_all_loggers(unconfigured, effects_capture):
  effects_capture.set_level(logging.WARNING)
  je.jit(_emit_all)(jnp.int32(1))
  assert _seen(effects_capture) == [(n, lv) for n, lv in ALL
                                    if lv in ("WARNING", "ERROR")]


def test_set_level_per_logger_nearest_name_wins(unconfigured, effects_capture):
  effects_capture.set_level("ERROR", logger="app")
  effects_capture.set_level(logging.INFO, logger="other")
  je.jit(_emit_all)(jnp.int32(1))
  assert _seen(effects_capture) == [
      (n, lv) for n, lv in ALL
      if n == "jax_effects" or (n == "app.sub" and lv == "ERROR")
      or (n == "other" and lv != "DEBUG")]


def test_set_level_overrides_an_explicit_logger_level(unconfigured,
                                                      effects_capture):
  logging.getLogger("other").setLevel(logging.ERROR)
  effects_capture.set_level(logging.DEBUG, logger="other")
  je.log("d", level=logging.DEBUG, logger="other")
  assert _seen(effects_capture) == [("other", "DEBUG")]


def test_set_level_applies_from_then_on(unconfigured, effects_capture):
  f = je.jit(lambda x: je.log("i {}", x, level=logging.INFO))
  f(1)
  effects_capture.set_level(logging.WARNING)
  f(2)
  effects_capture.set_level(logging.INFO)
  f(3)
  assert [r.getMessage() for r in effects_capture.logged] == ["i 1", "i 3"]


def test_an_explicit_logger_level_decides(unconfigured, effects_capture,
                                          caplog):
  caplog.set_level(logging.WARNING, logger="jax_effects")
  logging.getLogger("app").setLevel(logging.ERROR)  # a parent of app.sub
  je.jit(_emit_all)(jnp.int32(1))
  assert _seen(effects_capture) == [
      (n, lv) for n, lv in ALL
      if (n == "jax_effects" and lv in ("WARNING", "ERROR"))
      or (n == "app.sub" and lv == "ERROR") or n == "other"]


def test_root_level_does_not_count_as_configuration(unconfigured,
                                                    effects_capture, caplog):
  caplog.set_level(logging.ERROR)  # the root logger
  je.log("dbg", level=logging.DEBUG)
  assert _seen(effects_capture) == [("jax_effects", "DEBUG")]


def test_logging_disable_and_disabled_loggers_are_honoured(unconfigured,
                                                           effects_capture):
  logging.disable(logging.INFO)
  try:
    je.log("i", level=logging.INFO)
    je.log("w", level=logging.WARNING)
  finally:
    logging.disable(logging.NOTSET)
  other = logging.getLogger("other")
  other.disabled = True
  try:
    je.log("x", level=logging.ERROR, logger="other")
  finally:
    other.disabled = False
  assert [r.getMessage() for r in effects_capture.logged] == ["w"]


def test_set_level_checks_its_arguments(effects_capture):
  with pytest.raises(ValueError, match="unknown level name 'LOUD'"):
    effects_capture.set_level("LOUD")
  with pytest.raises(TypeError, match="level must be an int or a level name"):
    effects_capture.set_level(None)


def test_no_records_built_for_disabled_levels_without_capture(unconfigured):
  # Without a capturing fixture, a disabled level costs no record: the
  # logger's record factory is never called.
  made = []
  factory = logging.getLogRecordFactory()

  def counting(*a, **k):
    made.append(a[0])
    return factory(*a, **k)

  logging.setLogRecordFactory(counting)
  try:
    f = je.jit(lambda x: je.log("d {}", x, level=logging.DEBUG))
    f(1)
    je.effects_barrier()
  finally:
    logging.setLogRecordFactory(factory)
  assert made == []


def test_readme_example_in_a_fresh_pytest_run(pytester):
  pytester.makepyfile(textwrap.dedent("""
      import logging
      import jax.numpy as jnp
      import jax_effects as jfx

      @jfx.jit
      def step(x):
          jfx.log("sum = {}", x.sum(), level=logging.INFO)
          jfx.log("detail", level=logging.DEBUG)
          return x

      def test_logged(effects_capture):
          step(jnp.arange(3.0))
          assert [r.getMessage() for r in effects_capture.logged] == [
              "sum = 3.0", "detail"]

      def test_set_level(effects_capture):
          effects_capture.set_level(logging.INFO)
          step(jnp.arange(3.0))
          assert [r.getMessage() for r in effects_capture.logged] == [
              "sum = 3.0"]

      def test_listeners_of_earlier_tests_are_gone(effects_capture):
          from jax_effects._runtime import output as _output
          assert len(_output._line_listeners) == 1
          assert len(_output._all_record_listeners) == 1
  """))
  result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
  result.assert_outcomes(passed=3)
