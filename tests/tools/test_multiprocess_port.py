"""The launcher's coordinator port (``design/errors.md``, "Multi-process
launcher"; ``design/multihost.md``, "Network exposure"): picked and bound
without a race (another port when the picked one was taken meanwhile); a
given port that is taken is a clear error, never a crash or a peer waiting
for the coordinator until its timeout.
"""
import errno
import ipaddress
import os
import socket

import pytest

from jax_effects._tools import launcher

TIMEOUT = 120
HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}


@pytest.fixture
def taken_port():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]


def test_given_port_in_use_is_a_clear_error(taken_port):
  with pytest.raises(OSError, match=f"port {taken_port} .*already in use") as info:
    launcher.launch("multiprocess_targets:process_index",
                         num_processes=2, devices_per_process=1,
                         timeout=TIMEOUT, env=ENV,
                         coordinator_port=taken_port)
  assert info.value.errno == errno.EADDRINUSE


def test_port_taken_after_it_was_picked_is_replaced(taken_port, monkeypatch):
  # The race: the picked port is taken before the coordinator binds it
  # (simulated: the first pick returns a port already in use). Process 0
  # sees it, the peers are stopped, and the launch runs on another port.
  picks = []
  real = launcher.free_port

  def racy_free_port(host="127.0.0.1"):
    port = taken_port if not picks else real(host)
    picks.append(port)
    return port

  monkeypatch.setattr(launcher, "free_port", racy_free_port)
  results = launcher.launch("multiprocess_targets:process_index",
                                 num_processes=2, devices_per_process=1,
                                 timeout=TIMEOUT, env=ENV)
  assert [r.result for r in results] == [0, 1]
  assert len(picks) == 2 and picks[0] == taken_port != picks[1]


def test_worker_reports_a_taken_port_and_exits_at_once(taken_port):
  # Process 0 of a launch given a port that is taken only after the
  # launcher's own check: the launcher is bypassed here by calling the
  # one-shot launch directly.
  results, failure = launcher._launch_once(
      "multiprocess_targets:process_index", 2, 1, TIMEOUT, ENV,
      f"127.0.0.1:{taken_port}")
  assert results[0].returncode == launcher.EXIT_PORT_IN_USE
  assert f"coordinator port {taken_port}" in results[0].stderr
  assert "already in use" in results[0].stderr
  assert results[1].returncode is None       # stopped, not left waiting
  assert "exited with code 75" in failure


def _loopback(address: str) -> bool:
  ip = ipaddress.ip_address(address)
  mapped = getattr(ip, "ipv4_mapped", None)
  return (mapped or ip).is_loopback


def test_launched_run_listens_on_loopback_only():
  # Every listener of every launched process (the coordination service in
  # process 0, the CPU collectives' connections) is bound to a loopback
  # address: nothing of a launched run is reachable from another host. (JAX's
  # default binds the coordinator to every interface.) Only the processes'
  # own socket tables are read; no traffic leaves loopback.
  results = launcher.launch("multiprocess_targets:listening_addresses",
                            num_processes=2, devices_per_process=2,
                            timeout=TIMEOUT, env=ENV)
  for r in results:
    assert r.result, r.describe()
    outside = [a for a in r.result if not _loopback(a[0])]
    assert not outside, (r.process_id, r.result)
  assert any(a[0] == "127.0.0.1" for a in results[0].result)


def test_port_check_probes_the_address_the_coordinator_binds():
  # The port is taken on another loopback address only (127.0.0.2): the
  # coordinator, bound to 127.0.0.1 like the check, can use it. (Before, the
  # check probed 127.0.0.1 while JAX bound every interface, which failed.)
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.2", 0))
    s.listen()
    port = s.getsockname()[1]
    results = launcher.launch("multiprocess_targets:process_index",
                              num_processes=2, devices_per_process=1,
                              timeout=TIMEOUT, env=ENV, coordinator_port=port)
  assert [r.result for r in results] == [0, 1]
