"""The package's import rules, read from the source (AST), and what
``import numkv`` loads.

The layers, bottom to top: ``_version``; ``_config``, ``_dtypes``,
``_validate``, ``_formats`` (the K/V formats' registry); what the kernels
run on (``_runtime``: the thread count and the pool, whose compiled protocol
every pool kernel calls); the kernels (``_kernels``: numba and llvmlite); the
wrappers (``_reference``, ``_scatter``,
``_attention``, ``_quantize``); the public surfaces (``cache``, ``layers``,
``onnx``, ``transformers``); the package ``__init__``; the command line
(``_cli``, ``__main__``).  A module imports only its own layer or those
below, never in a cycle; only the kernels, the pool's protocol and the jit
factory import numba or llvmlite.
"""

import ast
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "numkv"

LAYERS = [
    ["numkv._version"],
    ["numkv._config", "numkv._dtypes", "numkv._validate", "numkv._formats"],
    ["numkv._runtime"],
    ["numkv._kernels"],
    ["numkv._reference", "numkv._scatter", "numkv._attention", "numkv._quantize"],
    ["numkv.cache", "numkv.layers", "numkv.onnx", "numkv.transformers"],
    ["numkv"],
    ["numkv._cli", "numkv.__main__"],
]
NUMBA_IMPORTERS = ("numkv._kernels", "numkv._config", "numkv._runtime.protocol")


def module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(name):
    """The layer of a module: the longest listed prefix decides."""
    best = None
    for index, names in enumerate(LAYERS):
        for prefix in names:
            if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    assert best is not None, f"{name} is in no layer: add it to LAYERS"
    return best[0]


def _is_module(name):
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or path.is_dir()


def imports(path, source=None):
    """``(module, line)`` for every import in the file, at any depth (lazy
    imports inside functions count), relative ones resolved; ``from numkv
    import _config`` imports the submodule, not the package's ``__init__``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            submodules = [f"{base}.{alias.name}" for alias in node.names if _is_module(f"{base}.{alias.name}")]
            if len(submodules) < len(node.names):
                found.append((base, node.lineno))
            found += [(module, node.lineno) for module in submodules]
    return found


def upward(name, others):
    return [f"{name} (layer {layer(name)}) imports {other} (layer {layer(other)})"
            for other in others if layer(other) > layer(name) and not name.startswith(other + ".")]


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {name: sorted({m for m, _ in imports(path) if m == "numkv" or m.startswith("numkv.")} - {name})
         for name, path in MODULES.items()}


def test_nothing_imports_upward():
    found = [line for name, others in GRAPH.items() for line in upward(name, others)]
    assert not found, "\n".join(found)


def test_no_import_cycle():
    # a package imports its own submodules' names only through its __init__; a
    # submodule's import of its parent package is the parent's __init__
    state, cycles = {}, []

    def visit(node, path):
        state[node] = "open"
        for other in GRAPH.get(node, ()):
            if other not in GRAPH:
                continue
            if state.get(other) == "open":
                cycles.append(" -> ".join(path[path.index(other):] + [other]))
            elif other not in state:
                visit(other, path + [other])
        state[node] = "done"

    for name in GRAPH:
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(cycles)


def test_only_the_kernels_the_protocol_and_the_jit_factory_import_numba_or_llvmlite():
    bad = [f"{name}:{line} imports {module}" for name, path in MODULES.items()
           if not name.startswith(NUMBA_IMPORTERS)
           for module, line in imports(path) if module.split(".")[0] in ("numba", "llvmlite")]
    assert not bad, "\n".join(bad)


def test_the_package_stays_small_at_the_top():
    # 16: the format registry (_formats) and the packed / paged wrappers
    # (_varlen) joined in one round; the next module needs a subpackage.
    assert len(list(PACKAGE.glob("*.py"))) <= 16


def test_import_numkv_is_light_and_the_command_line_imports_no_peer():
    """``import numkv`` loads neither numba, onnx, a peer nor the command line,
    in well under 2 s; the command line's own import adds no plotting nor peer."""
    code = """
import sys, time
t = time.perf_counter(); import numkv; took = time.perf_counter() - t
heavy = ('numba', 'llvmlite', 'onnx', 'onnxruntime', 'torch', 'transformers', 'matplotlib')
bad = sorted({m.split('.')[0] for m in sys.modules} & set(heavy))
bad += sorted(m for m in sys.modules if m.startswith(('numkv._cli', 'numkv.__main__', 'numkv.onnx', 'numkv.transformers')))
import numkv.__main__, numkv._cli.bench, numkv._cli.timing
bad += sorted({m.split('.')[0] for m in sys.modules} & {'matplotlib', 'torch', 'onnxruntime', 'onnx'})
print(bad, took)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT).stdout.split()
    assert out[0] == "[]", out
    assert float(out[1]) < 2.0  # ~0.1 s quiet; generous for a loaded machine


def test_the_rules_see_a_lazy_upward_import():
    """The checker can fail: a wrapper with a command-line import inside a
    function is caught."""
    source = "import numpy\n\ndef f():\n    from ._cli import timing\n    from . import _config\n"
    found = {m for m, _ in imports(PACKAGE / "_attention.py", source)}
    assert found == {"numpy", "numkv._cli.timing", "numkv._config"}
    assert upward("numkv._attention", ["numkv._cli.timing", "numkv._config"]) == [
        "numkv._attention (layer 4) imports numkv._cli.timing (layer 7)"]


# -- the K/V formats: one registry (numkv._formats), no hand-kept lists --------------------


def _format_names():
    """The registry's format names that are not also a NumPy / ml_dtypes
    dtype name (``int8``, ``int4`` are both: a dtype list may hold them)."""
    import ml_dtypes
    import numpy as np

    from numkv._formats import NAMES

    def is_dtype(name):
        try:
            np.dtype(getattr(ml_dtypes, name, name))
        except TypeError:
            return False
        return True

    return {name for name in NAMES if not is_dtype(name)}


def hard_coded_formats(path, source=None, names=None):
    """``(line, what)`` where a module spells format names as data: a tuple,
    list, set or dict literal holding one, or a comparison with one (``fmt
    == "q8_0"``, ``fmt in ("q8_0", ...)``) -- the lists and branches the
    registry's records replace.  Docstrings, messages and comments may name
    formats."""
    names = _format_names() if names is None else names
    found = []
    tree = ast.parse(path.read_text() if source is None else source, str(path))

    def named(node):
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names

    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [key for key in node.keys if key is not None]
        elif isinstance(node, ast.Compare):
            items = [node.left, *node.comparators]
        else:
            continue
        hits = [item.value for item in items if named(item)]
        if hits:
            found.append((node.lineno, f"{type(node).__name__} with {', '.join(hits)}"))
    return found


def test_no_module_hard_codes_a_format_list():
    """Caches, checks, bench cases, warmup groups, demo choices and the
    transformers dtypes take their formats from ``numkv._formats``; only the
    registry spells them as data."""
    bad = [f"{name}:{line}: {what}" for name, path in MODULES.items() if name != "numkv._formats"
           for line, what in hard_coded_formats(path)]
    bad += [f"asv_benchmarks/{path.name}:{line}: {what}" for path in sorted((ROOT / "asv_benchmarks").glob("*.py"))
            if path.name != "_common.py"  # (its fallback: the formats of a numkv before the registry)
            for line, what in hard_coded_formats(path)]
    assert not bad, "\n".join(bad)


def test_the_format_list_check_can_fail():
    names = _format_names()
    assert {"q8_0", "q4_0", "q4_1"} <= names and "int8" not in names
    for source in ('FORMATS = ("q8_0", "q4_0")\n', 'if fmt == "q4_1":\n    pass\n',
                   'ok = fmt in ["q8_0"]\n', 'BYTES = {"q4_0": 18}\n'):
        assert hard_coded_formats(PACKAGE / "cache.py", source), source
    assert not hard_coded_formats(PACKAGE / "cache.py", '"""a q8_0 cache"""\nx = f"{fmt} like q8_0"\n')
