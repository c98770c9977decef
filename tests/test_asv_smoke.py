"""Every asv benchmark still runs: setup, one call, teardown, for its first
parameter set (benchmarks rot: nothing else calls them).

Runs with ``NUMKV_BENCH_QUICK=1`` (set before the benchmark modules are
imported), which skips the large cases and shrinks the peak-memory prefill.  A
setup that raises ``NotImplementedError`` is asv's "skipped" (a missing peer,
an API not there yet) and is a pytest skip here; any other error fails.
``timeraw_`` benchmarks are run the way asv runs them, in a fresh interpreter.
"""

import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "asv_benchmarks"
PREFIXES = ("time_", "timeraw_", "peakmem_", "mem_", "track_")

os.environ["NUMKV_BENCH_QUICK"] = "1"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _modules():
    return sorted(m.name for m in pkgutil.iter_modules([str(BENCH_DIR)]) if not m.name.startswith("_"))


def _benchmarks():
    """(id, module name, class name or None, method name) for every benchmark."""
    found = []
    for name in _modules():
        module = importlib.import_module(f"asv_benchmarks.{name}")
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj) and attr.startswith(PREFIXES):
                found.append((f"{name}.{attr}", name, None, attr))
            elif inspect.isclass(obj):
                for method in sorted(dir(obj)):
                    if method.startswith(PREFIXES) and callable(getattr(obj, method)):
                        found.append((f"{name}.{attr}.{method}", name, attr, method))
    return found


BENCHMARKS = _benchmarks()


def _first_params(obj):
    """The first parameter combination, asv's way: ``params`` is a list of
    lists (one per parameter) or, for a single parameter, a plain list."""
    params = getattr(obj, "params", None)
    if not params:
        return ()
    if not isinstance(params[0], (list, tuple)):
        params = [params]
    return tuple(p[0] for p in params)


def _run_timeraw(code):
    stmt, setup = code if isinstance(code, tuple) else (code, "")
    source = textwrap.dedent(setup) + "\n" + textwrap.dedent(stmt)
    done = subprocess.run([sys.executable, "-c", source], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_benchmarks_found():
    assert _modules(), f"no benchmark modules in {BENCH_DIR}"
    kinds = {bench_id.rsplit(".", 1)[-1].split("_", 1)[0] for bench_id, *_ in BENCHMARKS}
    assert {"time", "timeraw", "peakmem", "track"} <= kinds, kinds


@pytest.mark.parametrize("module_name, class_name, method", [b[1:] for b in BENCHMARKS],
                         ids=[b[0] for b in BENCHMARKS])
def test_benchmark_runs(module_name, class_name, method):
    module = importlib.import_module(f"asv_benchmarks.{module_name}")
    if class_name is None:
        func = getattr(module, method)
        instance, params = None, _first_params(func)
        setup = getattr(func, "setup", None)
        teardown = getattr(func, "teardown", None)
    else:
        instance = getattr(module, class_name)()
        func = getattr(instance, method)
        params = _first_params(instance)
        setup = getattr(instance, "setup", None)
        teardown = getattr(instance, "teardown", None)
    try:
        if setup is not None:
            setup(*params)
    except NotImplementedError as e:
        pytest.skip(f"asv would skip it: {e}")
    try:
        result = func(*params)
        if method.startswith("timeraw_"):
            _run_timeraw(result)
        elif method.startswith("track_"):
            assert isinstance(result, (int, float)) and result == result, result
    finally:
        if teardown is not None:
            teardown(*params)
