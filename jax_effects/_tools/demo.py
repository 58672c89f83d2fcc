"""``python -m jax_effects demo``: a tour of ordered side effects, in seconds.

The demo is a list of sections (:data:`SECTIONS`, name -> function taking the
parsed options). Each section prints a heading and shows one feature with
real jitted code. Options are declared in :func:`add_arguments`, so new
sections can bring their own (``--sections`` picks which run).

JAX is configured before its backend starts: :func:`configure` sets
``jax_num_cpu_devices`` (default 8) so multi-device sections have devices to
use on a CPU-only machine.
"""
from __future__ import annotations

import argparse
import builtins
import sys
import time
from typing import Callable

DEFAULT_DEVICES = 8


def heading(title: str) -> None:
  builtins.print(f"\n=== {title} ===", flush=True)


def say(text: str) -> None:
  builtins.print(text, flush=True)


# --- sections ---------------------------------------------------------------------

def section_ordered_printing(args) -> None:
  """Prints from jitted code with cond, while_loop (effects in cond_fun too)
  and scan, in program order."""
  import jax
  from jax import lax
  import jax.numpy as jnp

  import jax_effects as je

  heading("ordered printing through cond / while_loop / scan")

  @je.jit
  def collatz(n):
    je.print("start n={}", n)

    def cond(c):
      je.print("  check n={}", c[0])
      return c[0] != 1

    def body(c):
      n, steps = c
      n = lax.cond(n % 2 == 0, lambda m: m // 2, lambda m: 3 * m + 1, n)
      je.print("  step {}: n={}", steps + 1, n)
      return n, steps + 1

    _, steps = lax.while_loop(cond, body, (n, 0))

    def running_sum(total, x):
      total = total + x
      je.print("  scan x={} total={}", x, total)
      return total, total

    total, _ = lax.scan(running_sum, 0, jnp.arange(1, 4))
    je.print("done: {} steps, scan total {}", steps, total)
    return steps

  collatz(jnp.int32(6))
  je.effects_barrier()
  text = collatz.lower(jax.ShapeDtypeStruct((), jnp.int32)).as_text()
  # Host calls: jax_effects' own target (CPU) or JAX's Python callback.
  calls = sum(text.count(f"@{target}(") for target in (
      je.HOST_TARGET, "xla_ffi_python_cpu_callback"))
  say(f"(its StableHLO threads !stablehlo.token values through "
      f"{calls} host callbacks)")


def section_callback(args) -> None:
  """A host callback with results that feed the rest of the computation."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jax_effects as je

  heading("callbacks with results")
  table = {"calls": 0}

  def lookup(x):
    table["calls"] += 1
    return {"square": np.float32(x * x), "calls": np.int32(table["calls"])}

  spec = {"square": jax.ShapeDtypeStruct((), jnp.float32),
          "calls": jax.ShapeDtypeStruct((), jnp.int32)}

  @je.jit
  def f(x):
    r = je.callback(lookup, spec, x)
    je.print("x={} -> square={} (host call #{})", x, r["square"], r["calls"])
    return r["square"] + 1

  for x in (1.0, 2.0, 3.0):
    f(jnp.float32(x))
  je.effects_barrier()


def section_named_effects(args) -> None:
  """Named effects: independent streams, each in order; runtime tokens."""
  import jax.numpy as jnp

  import jax_effects as je

  heading("named effects")
  metrics, audit = je.Effect("metrics"), je.Effect("audit")

  @je.jit
  def step(i):
    je.print("[metrics] step {} loss={:.3f}", i, 1.0 / (i + 1.0),
             effect=metrics)
    je.print("[audit]   step {} ok", i, effect=audit)
    return i + 1

  i = jnp.int32(0)
  for _ in range(3):
    i = step(i)
  je.effects_barrier()
  tokens = je.runtime_tokens()
  say("runtime tokens of this thread: "
      + ", ".join(sorted(e.name for e in tokens.effects)))
  say("(lines of one effect are in order; the two streams are independent)")


def section_barrier(args) -> None:
  """effects_barrier waits for effects dispatched asynchronously."""
  import jax.numpy as jnp

  import jax_effects as je

  heading("effects_barrier")
  done = []

  def slow(i):
    time.sleep(0.05)
    done.append(int(i))

  @je.jit
  def f(i):
    je.callback(slow, None, i)
    return i

  for i in range(5):
    f(jnp.int32(i))  # returns once dispatched; the callback may still run
  je.effects_barrier()  # blocks on the runtime and output tokens
  say(f"dispatched 5 calls (50 ms of callback each); after effects_barrier() "
      f"every callback has run, in order: {done}")


def section_multidevice(args) -> None:
  """Ordered effects on many devices: sharded jit, shard_map, log records,
  and the deterministic view."""
  import logging

  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  import numpy as np

  import jax_effects as je

  heading("multi-device: sharded jit, shard_map, log, deterministic view")
  devices = jax.devices()
  if len(devices) < 2:
    say(f"(skipped: needs several devices, have {len(devices)})")
    return
  n = len(devices)
  mesh = Mesh(np.array(devices), ("i",))

  say("token follows single-device work (device of each call's token):")
  step = je.jit(lambda x: (je.print("  on device {}", x), x)[1])
  for d in (0, n - 1, 1):
    step(jax.device_put(jnp.int32(d), devices[d]))
    token = je.runtime_tokens().effects[je.DEFAULT]
    je.effects_barrier()
    say(f"  -> runtime token now on {sorted(x.id for x in token.devices())}")

  say(f"jit over an array sharded on {n} devices: printed once, whole value:")
  x = jax.device_put(jnp.arange(n), NamedSharding(mesh, P("i")))
  je.jit(lambda x: (je.print("  x={}", x), x)[1])(x)
  je.effects_barrier()

  say("shard_map: per-device lines ([device D shard S process P]), each "
      "device in program order; deterministic() sorts them by (program "
      "point, device):")

  def body(v):
    je.print("first  {}", v[0])
    je.print("second {}", v[0] * 10)
    je.log("record {}", v[0])
    return v

  per_device = je.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"),
                                    out_specs=P("i")))
  handler = logging.StreamHandler(sys.stdout)
  handler.setFormatter(logging.Formatter(
      "  log record: device_id=%(device_id)s shard_index=%(shard_index)s "
      "process_index=%(process_index)s: %(message)s"))
  logger = logging.getLogger("jax_effects")
  old_level, old_propagate = logger.level, logger.propagate
  logger.addHandler(handler)
  logger.setLevel(logging.INFO)
  logger.propagate = False
  try:
    with je.deterministic():
      per_device(jnp.arange(n))
  finally:
    logger.removeHandler(handler)
    logger.setLevel(old_level)
    logger.propagate = old_propagate


#: name -> section function(args); run in this order.
SECTIONS: dict[str, Callable] = {
    "printing": section_ordered_printing,
    "callback": section_callback,
    "named": section_named_effects,
    "barrier": section_barrier,
    "multidevice": section_multidevice,
}


# --- command line ------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument(
      "--sections", default=None,
      help=f"comma-separated sections to run (default: all of "
           f"{', '.join(SECTIONS)})")
  parser.add_argument(
      "--devices", type=int, default=DEFAULT_DEVICES,
      help="number of simulated CPU devices (jax_num_cpu_devices)")
  parser.add_argument(
      "--processes", type=int, default=None, metavar="N",
      help="run the multi-process demo instead: N JAX processes on this "
           "machine (jax.distributed on 127.0.0.1), each logging per device "
           "in a shard_map over all their devices")
  parser.add_argument(
      "--devices-per-process", type=int, default=2, metavar="D",
      help="simulated CPU devices of each process with --processes "
           "(default 2)")


def configure(args) -> None:
  """Configures JAX before its backend starts."""
  import jax
  jax.config.update("jax_num_cpu_devices", args.devices)


def run(args) -> int:
  if args.processes is not None:
    return run_processes(args)
  configure(args)
  names = list(SECTIONS) if not args.sections else \
      [s.strip() for s in args.sections.split(",") if s.strip()]
  unknown = [n for n in names if n not in SECTIONS]
  if unknown:
    builtins.print(f"unknown section(s) {unknown}; choose from "
                   f"{list(SECTIONS)}", file=sys.stderr)
    return 2
  import jax
  say(f"jax {jax.__version__}, {len(jax.devices())} {jax.default_backend()} "
      f"device(s)")
  for name in names:
    SECTIONS[name](args)
  return 0


def run_processes(args) -> int:
  """``--processes N``: the multi-process demo (``multiprocess_program``).

  This process only launches and reports; it starts no JAX backend.
  """
  if args.processes < 1 or args.devices_per_process < 1:
    builtins.print("--processes and --devices-per-process must be >= 1",
                   file=sys.stderr)
    return 2
  from jax_effects._tools import multiprocess_program
  heading(f"multi-process: {args.processes} processes")
  return multiprocess_program.demo(args.processes, args.devices_per_process,
                                   out=say)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jax_effects demo",
                                   description=__doc__.splitlines()[0])
  add_arguments(parser)
  return run(parser.parse_args(argv))
