"""``python -m numkv [info|demo|bench]``: what numkv runs on, and what it does.

Uses the public API only.
"""

import argparse
import sys
import time

import numpy as np

import numkv


def info(args=None):
    """Version, numba threading, and one small scatter (compiles on first use)."""
    from numkv._config import runtime_info

    cache = np.zeros((4, 8, 256, 128), np.float32)
    update = np.ones((4, 8, 16, 128), np.float32)
    start = time.perf_counter()
    present = numkv.tensor_scatter(cache, update, np.array([0, 16, 32, 240]), mode="circular")
    elapsed = time.perf_counter() - start
    numba_version, threads, layer = runtime_info()
    print(f"numkv {numkv.__version__}  (numba {numba_version}, numpy {np.__version__})")
    print(f"threads: {threads}  threading layer: {layer}")
    print(
        f"tensor_scatter: wrote {update.shape} into {cache.shape} in {elapsed * 1e3:.1f} ms "
        f"(first call, includes compilation); rows written: {int(present[:, 0, :, 0].sum())}"
    )


def main(argv=None):
    from numkv import _cli_bench, _cli_demo

    parser = argparse.ArgumentParser(prog="python -m numkv", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("info", help="version, threading layer, a tiny scatter (the default)")
    _cli_demo.add_parser(sub)
    _cli_bench.add_parser(sub)
    args = parser.parse_args(argv)
    getattr(args, "run", info)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
