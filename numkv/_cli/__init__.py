"""The numkv command line: ``python -m numkv COMMAND`` or ``numkv COMMAND``.

  info     versions, BLAS, threads and threading, kernel cache (the default)
  demo     greedy decoding with and without KV caches: agreement and tokens/s
  bench    numkv's speed beside onnx.reference and the installed peers
  warmup   compile every kernel into numba's disk cache ahead of time

Each command takes --help.  Uses the public API (and, for info and warmup,
numba's own view of numkv's kernels).
"""

import argparse
import os
import sys

from numkv._version import __version__


def _prog():
    """What the user typed: the ``numkv`` script, or ``python -m numkv``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "numkv" if name in ("numkv", "numkv.exe") else "python -m numkv"


def build_parser(prog=None):
    from numkv._cli import bench, demo, info, warmup

    parser = argparse.ArgumentParser(
        prog=prog or _prog(),
        description="The numkv command line: python -m numkv COMMAND, or numkv COMMAND.",
        epilog="Without a command: info.  `COMMAND --help` describes each.")
    parser.add_argument("--version", action="version", version=f"numkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info.add_parser(sub)
    demo.add_parser(sub)
    bench.add_parser(sub)
    warmup.add_parser(sub)
    return parser


def main(argv=None):
    from numkv._cli import info

    args = build_parser().parse_args(argv)
    # Options that are each valid but not together: a usage error too, before any work.
    check = getattr(args, "check", None)
    if check is not None:
        problem = check(args)
        if problem:
            args.parser.error(problem)
    getattr(args, "run", info.run)(args)
    return 0

