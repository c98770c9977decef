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
factory import numba or llvmlite.  The wrappers' tuning constants live in
``_config``'s Tunables and are read there at call time; the K/V formats in
one registry.
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


# -- the tunables: one home (numkv._config), read at call time ----------------------------

# Module-level numbers outside ``_config`` that define something rather than
# tune it (a test of the tunables' rule would otherwise take them for policy).
DEFINITIONS = {
    ("numkv._attention", "SOFTMAX_PRECISIONS"): "ONNX TensorProto codes",
    ("numkv._attention", "QUERY_BLOCK"): "qk_precision='int8''s block: what Y is",
    ("numkv._attention", "_NO_MASK_ROW"): "the kernel's desc row of an absent mask",
    ("numkv._quantize", "BLOCK"): "the block formats' block",
    ("numkv._quantize", "_FLOAT16_LIMIT"): "float16's largest finite value, rounded up",
    ("numkv._scatter", "_C_CONTIGUOUS"): "NumPy's flag bits",
    ("numkv._scatter", "_ALIGNED"): "NumPy's flag bits",
    ("numkv._scatter", "_WRITEABLE"): "NumPy's flag bits",
    ("numkv._formats", "FIRST_CODE"): "the kernels' format codes",
}
# Where a module-level number is not the wrappers' policy: the jit factory's
# home; compile-time constants baked into machine code (the kernels, the
# pool's compiled protocol and its control block's layout); the command
# line's bench shapes and timing.
NOT_WRAPPERS = ("numkv._config", "numkv._kernels", "numkv._runtime.control", "numkv._runtime.protocol",
                "numkv._cli")


def config_tunables():
    """The names ``_config`` binds below its ``# Tunables`` heading."""
    source = (PACKAGE / "_config.py").read_text()
    heading = source.splitlines().index("# Tunables") + 1
    return {name for node in ast.parse(source).body if isinstance(node, ast.Assign) and node.lineno > heading
            for name in _bound_names(node)}


def _bound_names(node):
    names = []
    for target in getattr(node, "targets", None) or [node.target]:
        names += [t.id for t in (target.elts if isinstance(target, ast.Tuple) else [target]) if isinstance(t, ast.Name)]
    return names


def _is_number(node):
    """A literal number, bool, or an expression / tuple of them (``1 << 18``)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float))
    if isinstance(node, ast.UnaryOp):
        return _is_number(node.operand)
    if isinstance(node, ast.BinOp):
        return _is_number(node.left) and _is_number(node.right)
    return isinstance(node, ast.Tuple) and all(map(_is_number, node.elts))


def tunable_breaches(path, source=None, tunables=None):
    """``(line, what)`` where a module keeps a tunable of its own: binds one of
    ``_config``'s tunables at module level (a copy ``_config``'s never
    reaches), imports one by name (``from ._config import THREAD_MACS``:
    frozen at import, so a test's ``monkeypatch.setattr(_config, ...)``
    misses it), binds a new constant to a number (a wrapper's policy belongs
    in ``_config``'s Tunables; a definition goes in ``DEFINITIONS``), or --
    in compiled code (``_kernels``) -- reads one (numba freezes it)."""
    name = module_name(path)
    tunables = config_tunables() if tunables is None else tunables
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    found, config_lines = [], {line for module, line in imports(path, source) if module == "numkv._config"}
    if not name.startswith(NOT_WRAPPERS):
        for node in tree.body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) or node.value is None:
                continue
            for bound in _bound_names(node):
                if bound in tunables:
                    found.append((node.lineno, f"binds {bound}, a _config tunable: read _config.{bound}"))
                elif bound.lstrip("_").isupper() and _is_number(node.value) and (name, bound) not in DEFINITIONS:
                    found.append((node.lineno, f"binds {bound} to a number: a tunable goes in _config's Tunables"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.lineno in config_lines:
            found += [(node.lineno, f"imports {alias.name} by name: read _config.{alias.name} at call time")
                      for alias in node.names if alias.name in tunables]
        elif (name.startswith("numkv._kernels") and isinstance(node, ast.Attribute) and node.attr in tunables
              and isinstance(node.value, ast.Name) and node.value.id == "_config"):
            found.append((node.lineno, f"reads _config.{node.attr} in compiled code (numba freezes it)"))
    return found


def _config_reads(path):
    """The names a module reads as ``_config.NAME``."""
    return {node.attr for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "_config"}


def test_the_tunables_live_in_config_and_are_read_through_it():
    """The wrappers' tile, thread and copy policy is ``_config``'s Tunables,
    and each is read (as ``_config.NAME``) by some module outside the kernels."""
    tunables = config_tunables()
    assert {"THREAD_MACS", "GEMM_MIN_ROWS", "PARALLEL_MIN_BYTES", "SPIN_US"} <= tunables  # (the heading parsed)
    bad = [f"{name}:{line}: {what}" for name, path in MODULES.items() for line, what in tunable_breaches(path)]
    read = set().union(*(_config_reads(path) for name, path in MODULES.items()
                         if not name.startswith("numkv._kernels")))
    bad += [f"numkv._config: {name} is read by no module" for name in sorted(tunables - read)]
    assert not bad, "\n".join(bad)


def test_the_tunable_check_can_fail():
    tunables = {"THREAD_MACS", "PARALLEL_MIN_BYTES"}
    wrapper, kernel = PACKAGE / "_attention.py", PACKAGE / "_kernels" / "scatter.py"
    for source in ("THREAD_MACS = 1 << 22\n", "NEW_MIN_BYTES = 1 << 20\n", "BIG, SMALL = 2.5, -1\n",
                   "from ._config import PARALLEL_MIN_BYTES\n", "from numkv._config import THREAD_MACS\n",
                   "from . import _config\nTHREAD_MACS = _config.THREAD_MACS\n",
                   "from ._runtime import pool\nfrom ._config import jit, THREAD_MACS\n"):
        assert tunable_breaches(wrapper, source, tunables), source
    assert tunable_breaches(kernel, "from .. import _config\n\ndef k():\n    return _config.THREAD_MACS\n", tunables)
    for source in ("from . import _config\n\ndef f(n):\n    return n < _config.PARALLEL_MIN_BYTES\n",
                   "QUERY_BLOCK = 32\n", "MODES = ('linear', 'circular')\n", "_kernels = None\n"):
        assert not tunable_breaches(wrapper, source, tunables), source
    assert not tunable_breaches(kernel, "AXPY_KEYS = 16\n", tunables)  # (compile-time: stays in the kernel)
