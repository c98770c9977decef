"""The package's import rules, read from the source (AST), and what
``import numkv`` loads.

The layers, bottom to top: ``_version``; ``_config``, ``_dtypes``,
``_validate``; what the kernels run on (``_runtime``: the thread count and
the pool, whose compiled protocol every pool kernel calls); the kernels
(``_kernels``: numba and llvmlite); the wrappers (``_reference``, ``_scatter``,
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
    ["numkv._config", "numkv._dtypes", "numkv._validate"],
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
    assert len(list(PACKAGE.glob("*.py"))) <= 15


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
