"""pytest plugin shipped with jax_effects (entry point ``pytest11``).

Installed with the package, it is active in every pytest run without any
conftest:

* ``effects_capture`` fixture: ``.printed`` lists the lines written by
  :func:`jax_effects.print` during the test, ``.logged`` the
  :class:`logging.LogRecord` objects emitted by :func:`jax_effects.log`, of
  every level unless ``.set_level(level, logger=None)`` (or the logger's
  own explicitly set level) says otherwise. Reading either runs
  :func:`jax_effects.effects_barrier` first.
* After every test phase the plugin runs
  ``jax_effects.effects_barrier(all_threads=True)``, so a callback error
  raised by a test's effects fails that test (in its call phase, or as a
  setup/teardown error for effects started by fixtures), never a later one.
* ``--jax-effects-devices=N`` / ini ``jax_effects_devices = N`` sets
  ``jax_num_cpu_devices`` before the JAX backend starts (before conftests
  are imported when the plugin is loaded by its entry point).

This module imports neither jax nor jax_effects' runtime at import time:
the barrier only runs once jax has been imported, and jax is imported in
``pytest_configure`` only when a device count is requested.
"""
from __future__ import annotations

import sys
from typing import Any

import pytest

_DEVICES_OPTION = "--jax-effects-devices"
_DEVICES_INI = "jax_effects_devices"
_APPLIED_KEY = pytest.StashKey[bool]()


# --------------------------------------------------------------------------
# Options and simulated device count.


def pytest_addoption(parser: pytest.Parser) -> None:
  group = parser.getgroup("jax_effects")
  group.addoption(
      _DEVICES_OPTION,
      dest="jax_effects_devices",
      default=None,
      metavar="N",
      help=(
          "number of simulated CPU devices for JAX (sets jax_num_cpu_devices "
          f"before the backend starts); overrides the ini key {_DEVICES_INI}"
      ),
  )
  parser.addini(
      _DEVICES_INI,
      help=f"number of simulated CPU devices for JAX (see {_DEVICES_OPTION})",
      default="",
  )


def _requested_devices(config: pytest.Config, namespace: Any) -> int | None:
  raw = getattr(namespace, "jax_effects_devices", None)
  source = _DEVICES_OPTION
  if raw is None or raw == "":
    raw = config.getini(_DEVICES_INI)
    source = f"ini key {_DEVICES_INI}"
  if raw is None or str(raw).strip() == "":
    return None
  try:
    n = int(str(raw).strip())
  except ValueError:
    n = 0
  if n < 1:
    raise pytest.UsageError(
        f"{source} must be a positive integer number of devices, got {raw!r}"
    )
  return n


def _apply_devices(config: pytest.Config, namespace: Any) -> None:
  if config.stash.get(_APPLIED_KEY, False):
    return
  n = _requested_devices(config, namespace)
  config.stash[_APPLIED_KEY] = True
  if n is None:
    return
  import jax

  from jax_effects import _compat
  if _compat.backends_are_initialized():
    try:
      have = len(jax.devices("cpu"))
    except RuntimeError:
      have = None
    if have == n:
      return
    raise pytest.UsageError(
        f"{_DEVICES_OPTION}={n} (or ini {_DEVICES_INI}) cannot take effect: "
        f"the JAX backend was already initialised with {have} CPU device(s) "
        "before the jax_effects pytest plugin configured it. Remove the code "
        "that runs JAX operations at import/configure time (e.g. in a "
        "conftest or another plugin), or set jax_num_cpu_devices there."
    )
  jax.config.update("jax_num_cpu_devices", n)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
  # Runs before conftests are imported, so a conftest that touches the
  # backend at import time still sees the requested device count.
  _apply_devices(early_config, early_config.known_args_namespace)


def pytest_configure(config: pytest.Config) -> None:
  # Fallback for a plugin registered after the initial conftests (e.g.
  # through ``pytest_plugins``); no-op when already applied.
  _apply_devices(config, config.option)


# --------------------------------------------------------------------------
# Barrier after each test phase.


def _barrier() -> None:
  """Runs effects_barrier(all_threads=True) if any JAX code can have run."""
  if "jax" not in sys.modules or "jax_effects" not in sys.modules:
    return
  import jax_effects

  barrier = getattr(jax_effects, "effects_barrier", None)
  if barrier is not None:
    barrier(all_threads=True)


def _note(exc: BaseException, phase: str) -> None:
  if hasattr(exc, "add_note"):
    exc.add_note(
        "(an error from this test's jax_effects effects, raised by the "
        "effects_barrier(all_threads=True) that the jax_effects pytest plugin "
        f"runs after each test's {phase})"
    )


def _run_phase_with_barrier(phase: str):
  try:
    result = yield
  except BaseException as test_exc:
    # The phase already failed; still drain its effects so they cannot
    # fail the next test, and attach a late callback error as a note.
    try:
      _barrier()
    except Exception as cb_exc:  # noqa: BLE001
      if hasattr(test_exc, "add_note"):
        test_exc.add_note(
            "jax_effects: a callback of this test also raised "
            f"{type(cb_exc).__name__}: {cb_exc}"
        )
    raise
  try:
    _barrier()
  except Exception as cb_exc:
    _note(cb_exc, phase)
    raise
  return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
  return (yield from _run_phase_with_barrier("setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
  return (yield from _run_phase_with_barrier("call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
  return (yield from _run_phase_with_barrier("teardown"))


# --------------------------------------------------------------------------
# effects_capture fixture.


class EffectsCapture:
  """What jax_effects printed and logged since the fixture was set up.

  ``logged`` holds every record ``jax_effects.log`` emitted during the test,
  of any level, without the test configuring ``logging`` (as if
  ``caplog.set_level`` had enabled every level of the loggers ``log``
  uses): a record the logger's level disables is captured all the same
  (its handlers do not see it). Where a logger (or a parent other than the
  root) has a level set explicitly, by the test or by the application
  (``caplog.set_level(logging.WARNING, logger="jax_effects")``), that level
  decides; :meth:`set_level` overrides both. ``logging.disable`` and
  ``logger.disabled`` are honoured.
  """

  def __init__(self) -> None:
    self._printed: list[str] = []
    self._logged: list[Any] = []
    self._levels: dict[str | None, int] = {}

  def _on_line(self, line: str) -> None:
    self._printed.append(line)

  def _on_record(self, record: Any, logger: Any, enabled: bool) -> None:
    if self._wants(record, logger, enabled):
      self._logged.append(record)

  def _wants(self, record: Any, logger: Any, enabled: bool) -> bool:
    """Whether to capture ``record`` (``enabled``: by its logger's level)."""
    import logging

    if logger.disabled or logging.root.manager.disable >= record.levelno:
      return False
    levels = self._levels
    if levels:
      name = record.name
      while True:  # the nearest set_level, by dotted name, decides
        if name in levels:
          return record.levelno >= levels[name]
        if "." not in name:
          break
        name = name.rsplit(".", 1)[0]
      if None in levels:
        return record.levelno >= levels[None]
    if enabled:
      return True
    lg = logger
    while lg is not None and lg is not logging.root:
      if lg.level != logging.NOTSET:  # configured explicitly: it decides
        return False
      lg = lg.parent
    return True

  def set_level(self, level: int | str, logger: str | None = None) -> None:
    """Captures records of ``level`` and above (of ``logger`` and its children).

    ``logger=None``: of every logger ``jax_effects.log`` uses; a name: of that
    logger and its children (the nearest name wins), whatever the logger's
    own level (below ``level`` nothing is captured, above everything is). Lasts until the end of the test (like ``caplog.set_level``,
    but without changing any logger).
    """
    import logging

    if isinstance(level, str):
      levels = logging.getLevelNamesMapping()
      if level.upper() not in levels:
        raise ValueError(
            f"effects_capture.set_level: unknown level name {level!r}; "
            f"expected one of {sorted(levels)} or an int")
      level = levels[level.upper()]
    elif isinstance(level, bool) or not isinstance(level, int):
      raise TypeError(
          f"effects_capture.set_level: level must be an int or a level name, "
          f"got {level!r}")
    if logger is not None and not isinstance(logger, str):
      logger = getattr(logger, "name", logger)
      if not isinstance(logger, str):
        raise TypeError(
            "effects_capture.set_level: logger must be None, a logger name "
            f"or a logging.Logger, got {logger!r}")
    self._sync()  # records already emitted were captured under the old level
    self._levels[logger] = level

  @staticmethod
  def _sync() -> None:
    import jax_effects

    jax_effects.effects_barrier(all_threads=True)

  @property
  def printed(self) -> list[str]:
    """Lines printed by ``jax_effects.print`` (no newlines), in order."""
    self._sync()
    return list(self._printed)

  @property
  def logged(self) -> list[Any]:
    """``logging.LogRecord`` objects emitted by ``jax_effects.log``."""
    self._sync()
    return list(self._logged)

  def clear(self) -> None:
    """Drops what was captured so far (after a barrier)."""
    self._sync()
    self._printed.clear()
    self._logged.clear()


@pytest.fixture
def effects_capture():
  """Captures jax_effects.print lines and jax_effects.log records."""
  from jax_effects._runtime import output as _output

  cap = EffectsCapture()
  _output.add_line_listener(cap._on_line)
  _output.add_record_listener(cap._on_record, all_levels=True)
  try:
    yield cap
    _barrier()  # deliver effects of later-torn-down fixtures too
  finally:
    _output.remove_line_listener(cap._on_line)
    _output.remove_record_listener(cap._on_record)
