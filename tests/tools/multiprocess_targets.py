"""Targets for the launcher's own tests (tests/tools/test_multiprocess*.py).

Run in child processes by ``jax_effects._tools.launcher.launch`` after
``jax.distributed.initialize``.
"""
import time

import jax


def fail_in_process_one():
  if jax.process_index() == 1:
    raise ValueError("process 1 fails on purpose")
  time.sleep(600)   # would wait for process 1 forever: the launcher kills it


def hang():
  time.sleep(600)


def process_index():
  return jax.process_index()


def listening_addresses():
  """The addresses this process listens on (TCP, IPv4 and IPv6), after a
  computation with a collective across the processes (which sets up the CPU
  collectives' connections): ``[[address, port], ...]``, read from
  ``/proc/net/tcp{,6}`` for this process's own sockets."""
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  x = jax.make_array_from_process_local_data(
      NamedSharding(mesh, P("d")),
      np.ones(jax.local_device_count(), np.float32))
  total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
  assert float(total) == jax.device_count()
  return _listening_sockets()


def _listening_sockets():
  import os
  import socket

  inodes = set()
  for fd in os.listdir("/proc/self/fd"):
    try:
      target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
      continue
    if target.startswith("socket:["):
      inodes.add(target[len("socket:["):-1])
  found = []
  for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
    with open(f"/proc/net/{table}") as f:
      next(f)
      for line in f:
        fields = line.split()
        if fields[3] != "0A" or fields[9] not in inodes:   # 0A: LISTEN
          continue
        address, port = fields[1].split(":")
        raw = bytes.fromhex(address)
        # (the kernel prints each 32-bit word in host byte order)
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
        found.append([socket.inet_ntop(family, raw), int(port, 16)])
  return found
