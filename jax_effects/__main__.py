"""``python -m jax_effects {demo,bench} [options]``.

``demo`` takes the options its sections declare (``demo.add_arguments``);
``bench`` hands the rest of the command line to ``bench.main``. Both modules
are imported only when their command runs.
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(
      prog="python -m jax_effects",
      description="Ordered side effects from compiled JAX code.")
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  demo_parser = sub.add_parser("demo", help="a tour of ordered side effects")
  from jax_effects._tools import demo  # imports no jax at module level
  demo.add_arguments(demo_parser)
  # (its options are the benchmark's: main hands them on unparsed)
  sub.add_parser("bench", help="benchmarks (see `bench --help`)", add_help=False)
  if argv and argv[0] == "bench":
    from jax_effects._tools import bench
    return bench.main(argv[1:]) or 0
  args = parser.parse_args(argv)   # (the command is demo: bench returned)
  return demo.run(args) or 0


if __name__ == "__main__":
  sys.exit(main())
