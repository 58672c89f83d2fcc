"""Tests of the pytest plugin (jax_effects/_tools/pytest_plugin.py) with
pytester (``design/architecture.md``, "Tools"; ``design/formatting.md``,
"Capture in tests"; README "In tests").

Inner pytest runs use ``runpytest_subprocess``: each gets a fresh JAX backend,
so device-count options can be checked, and the plugin is loaded the way users
get it, through the installed package's ``pytest11`` entry point.
"""
import textwrap

import pytest

from helpers import run_script

pytest_plugins = ["pytester"]


def _run(pytester, *args):
  return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)


def test_plugin_is_loaded_through_entry_point(pytestconfig):
  from jax_effects._tools import pytest_plugin
  assert pytestconfig.pluginmanager.get_plugin("jax_effects") is pytest_plugin


def test_importing_plugin_does_not_start_backend():
  code = textwrap.dedent("""
      import sys
      import jax_effects._tools.pytest_plugin
      if "jax" in sys.modules:
        from jax._src import xla_bridge
        assert not xla_bridge.backends_are_initialized()
      print("ok")
  """)
  out = run_script(code, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "ok"


def test_devices_option(pytester):
  pytester.makepyfile("""
      import jax
      def test_devices():
        assert len(jax.devices()) == 3
  """)
  _run(pytester, "--jax-effects-devices=3").assert_outcomes(passed=1)


def test_devices_ini_and_option_overrides_ini(pytester, monkeypatch):
  pytester.makeini("""
      [pytest]
      jax_effects_devices = 2
  """)
  pytester.makepyfile("""
      import os, jax
      def test_devices():
        assert len(jax.devices()) == int(os.environ["EXPECTED_DEVICES"])
  """)
  monkeypatch.setenv("EXPECTED_DEVICES", "2")
  _run(pytester).assert_outcomes(passed=1)
  monkeypatch.setenv("EXPECTED_DEVICES", "5")
  _run(pytester, "--jax-effects-devices=5").assert_outcomes(passed=1)


def test_devices_applied_before_conftest_import(pytester):
  # A conftest that starts the backend at import time still sees N devices.
  pytester.makeconftest("""
      import jax
      DEVICES_AT_IMPORT = len(jax.devices())
  """)
  pytester.makepyfile("""
      from conftest import DEVICES_AT_IMPORT
      def test_devices():
        assert DEVICES_AT_IMPORT == 4
  """)
  _run(pytester, "--jax-effects-devices=4").assert_outcomes(passed=1)


def test_devices_after_backend_started_is_usage_error(pytester, monkeypatch):
  # A plugin given with -p is imported before ours configures JAX.
  pytester.makepyfile(earlyjax="""
      import jax
      jax.devices()
  """)
  pytester.makepyfile("def test_x(): pass")
  monkeypatch.setenv("PYTHONPATH", str(pytester.path))
  result = _run(pytester, "-p", "earlyjax", "--jax-effects-devices=3")
  assert result.ret == pytest.ExitCode.USAGE_ERROR
  result.stderr.fnmatch_lines(["*--jax-effects-devices=3*already initialised*"])


def test_devices_invalid_value_is_usage_error(pytester):
  pytester.makepyfile("def test_x(): pass")
  result = _run(pytester, "--jax-effects-devices=zero")
  assert result.ret == pytest.ExitCode.USAGE_ERROR
  result.stderr.fnmatch_lines(["*--jax-effects-devices must be a positive*"])


_FAILING_THEN_CLEAN = """
    import threading

    import jax
    import jax.numpy as jnp
    import jax_effects as jfx

    class Boom(Exception):
      pass

    release = threading.Event()

    def explode(x):
      if x > 0:
        release.wait(60)   # (until its call has returned)
        raise Boom("boom from callback")
      return x

    @jfx.jit
    def bad(x):
      # (enough work that XLA runs it asynchronously, not inline in the call)
      x = x + jnp.ones((256, 256)).dot(jnp.ones((256, 256)))[0, 0] * 0
      return jfx.callback(explode, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    @jfx.jit
    def good(x):
      jfx.print("clean {}", x)
      return x + 1

    def test_a_failing_callback():
      # The first call waits for its callback (user code, ``launch_lock``);
      # the second returns before its callback raises, its result never
      # read: only the plugin's barrier after this test sees its error.
      bad(jnp.float32(0.0))
      bad(jnp.float32(1.0))
      release.set()

    def test_b_clean_capture(effects_capture):
      good(jnp.int32(7))
      assert effects_capture.printed == ["clean 7"]
"""


def test_failing_callback_fails_its_own_test_only(pytester):
  pytester.makepyfile(_FAILING_THEN_CLEAN)
  result = _run(pytester, "-v")
  result.assert_outcomes(failed=1, passed=1, errors=0)
  result.stdout.fnmatch_lines([
      "*test_a_failing_callback FAILED*",
      "*test_b_clean_capture PASSED*",
  ])
  result.stdout.fnmatch_lines(["*Boom*boom from callback*"])


def test_failing_callback_under_xdist(pytester):
  pytester.makepyfile(_FAILING_THEN_CLEAN)
  result = _run(pytester, "-n", "2", "--jax-effects-devices=2")
  result.assert_outcomes(failed=1, passed=1, errors=0)
  result.stdout.fnmatch_lines(["*FAILED*test_a_failing_callback*"])


def test_capture_printed_and_logged(pytester):
  pytester.makepyfile("""
      import logging
      import jax.numpy as jnp
      import jax_effects as jfx

      @jfx.jit
      def f(x):
        jfx.print("first {}", x)
        jfx.log("logged {}", x + 1, level=logging.WARNING)
        jfx.print("second {}", x + 2)
        return x

      def test_capture(effects_capture):
        f(jnp.int32(1))
        assert effects_capture.printed == ["first 1", "second 3"]
        recs = effects_capture.logged
        assert [r.getMessage() for r in recs] == ["logged 2"]
        assert recs[0].levelno == logging.WARNING
        assert recs[0].name == "jax_effects"

      def test_capture_is_per_test(effects_capture):
        assert effects_capture.printed == []
        assert effects_capture.logged == []
  """)
  _run(pytester, "-v").assert_outcomes(passed=2)


def test_callback_error_in_failing_test_does_not_leak(pytester):
  # The callback's error comes after its call returned: the plugin's
  # barrier after the failed phase drains it, as a note on the test's own
  # failure, and only this test fails.
  pytester.makepyfile("""
      import threading

      import jax
      import jax.numpy as jnp
      import jax_effects as jfx

      release = threading.Event()

      def explode(x):
        if x > 0:
          release.wait(60)   # (until its call has returned)
          raise KeyError("late callback")
        return x

      @jfx.jit
      def bad(x):   # (asynchronous: see _FAILING_THEN_CLEAN)
        x = x + jnp.ones((256, 256)).dot(jnp.ones((256, 256)))[0, 0] * 0
        return jfx.callback(explode, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

      def test_fails_twice():
        bad(jnp.float32(0.0))   # (waits for its callback: a first call)
        bad(jnp.float32(1.0))   # (returns before its callback raises)
        release.set()
        assert False, "test's own failure"

      def test_next_is_clean():
        pass
  """)
  result = _run(pytester, "-v")
  result.assert_outcomes(failed=1, passed=1, errors=0)
  result.stdout.fnmatch_lines(["*late callback*"])
