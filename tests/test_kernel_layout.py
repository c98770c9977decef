"""The kernel folder's layout, read from the source (AST): its layers, an
algorithm module free of IR, and the digests that keep numba's disk cache
honest.

numba's disk cache notices edits to a kernel's own file only (the index is
stamped with that file's modification time and size), yet a kernel compiles
into itself the helpers it calls from other files -- intrinsics' IR,
inlined functions, callees.  So each kernel module that does holds
``HELPERS_SHA256``, the digest of the sources of every ``numkv`` module it
imports (and theirs); when a helper changes, the test below fails and prints
the new value, and setting it changes the kernel's own file, so numba
recompiles instead of loading stale machine code.
"""

import ast
import hashlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNELS = ROOT / "numkv" / "_kernels"

# Bottom to top: a module imports only modules of lower layers (and none of
# its own layer, so no cycle either).
KERNEL_LAYERS = [
    ["layout", "cpu", "compiler"],
    ["simd"],
    ["gemm", "widen", "softmax"],
    ["decode_loops"],
    ["loop_functions"],
    ["attention", "narrow", "quantize", "scatter", "read_bandwidth"],
]


def _path(module):
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def numkv_imports(module):
    """The ``numkv`` modules ``module`` imports, at any depth, relative
    imports resolved (``from . import x`` imports the submodule ``x``)."""
    path = _path(module)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if _path(sub).exists() else base)
    return {name for name in found if name == "numkv" or name.startswith("numkv.")} - {module}


def helpers(module):
    """Every ``numkv`` module ``module`` imports, and theirs (not itself)."""
    seen, todo = set(), [module]
    while todo:
        for other in numkv_imports(todo.pop()):
            if other not in seen:
                seen.add(other)
                todo.append(other)
    return sorted(seen - {module})


def helpers_sha256(module):
    """sha256 of the helpers' names and sources (line endings as ``\\n``)."""
    digest = hashlib.sha256()
    for name in helpers(module):
        digest.update(name.encode() + b"\0" + _path(name).read_bytes().replace(b"\r\n", b"\n") + b"\0")
    return digest.hexdigest()


def _compiles_kernels(tree):
    """Whether a module defines a jitted function that is compiled, and
    cached, on its own: ``@jit(...)`` without ``inline=True`` (an inlined
    helper compiles into its callers), or ``@c_function(...)``."""
    for node in ast.walk(tree):
        for deco in getattr(node, "decorator_list", ()):
            if isinstance(deco, ast.Call) and getattr(deco.func, "id", None) == "c_function":
                return True
            if isinstance(deco, ast.Call) and getattr(deco.func, "id", None) == "jit":
                if not any(k.arg == "inline" and getattr(k.value, "value", False) for k in deco.keywords):
                    return True
    return False


def _constant(tree, name):
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    return None


KERNEL_MODULES = sorted(f"numkv._kernels.{p.stem}" for p in KERNELS.glob("*.py") if p.stem != "__init__")
# The modules whose cached kernels compile helpers from other files: of the
# folder, or the pool's protocol and its control block (``numkv._runtime``).
RUNTIME_MODULES = sorted(f"numkv._runtime.{p.stem}" for p in (ROOT / "numkv" / "_runtime").glob("*.py")
                         if p.stem != "__init__")
GUARDED = [m for m in KERNEL_MODULES + RUNTIME_MODULES
           if _compiles_kernels(ast.parse(_path(m).read_text()))
           and any(h.startswith(("numkv._kernels.", "numkv._runtime.")) for h in numkv_imports(m))]


def test_the_guarded_modules_are_the_expected_ones():
    # A new module whose kernels inline helpers joins GUARDED by itself;
    # this pins the list so that losing one (a parsing slip) shows.
    assert {"numkv._kernels.attention", "numkv._kernels.loop_functions", "numkv._kernels.narrow",
            "numkv._kernels.scatter", "numkv._runtime.protocol"} <= set(GUARDED)


@pytest.mark.parametrize("module", GUARDED, ids=lambda m: m.rpartition(".")[2])
def test_a_kernel_module_holds_the_digest_of_its_helpers(module):
    want = helpers_sha256(module)
    got = _constant(ast.parse(_path(module).read_text()), "HELPERS_SHA256")
    assert got == want, (
        f"a helper of {module} changed ({', '.join(helpers(module))}): numba's disk cache would load "
        f"stale kernels.  Set, in {_path(module).relative_to(ROOT)}:\nHELPERS_SHA256 = \"{want}\"")


def test_kernel_modules_import_only_lower_layers():
    rank = {f"numkv._kernels.{name}": i for i, names in enumerate(KERNEL_LAYERS) for name in names}
    missing = [m for m in KERNEL_MODULES if m not in rank]
    assert not missing, f"add {missing} to KERNEL_LAYERS"
    upward = [f"{m} imports {o}" for m in KERNEL_MODULES for o in numkv_imports(m)
              if o in rank and rank[o] >= rank[m]]
    assert not upward, "\n".join(upward)


def test_the_algorithm_module_holds_no_ir_and_reads_top_down():
    """``attention.py`` is the algorithm: no IR builder calls (those live in
    simd, widen, decode_loops, gemm), short enough to read, and the entry
    point first."""
    source = (KERNELS / "attention.py").read_text()
    tree = ast.parse(source)
    ir_calls = [f"line {node.lineno}" for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in ("builder", "ir", "cgutils")]
    assert not ir_calls, f"IR in attention.py: {ir_calls}"
    assert "llvmlite" not in {m for m in numkv_imports("numkv._kernels.attention")}
    assert not any(isinstance(n, ast.ImportFrom) and (n.module or "").startswith("llvmlite") for n in ast.walk(tree))
    assert len(source.splitlines()) <= 900
    functions = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert functions[0] == "attention_items", functions[:3]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the exception it prints
def test_a_c_function_that_stops_on_an_exception_makes_its_caller_raise():
    """numba's C functions print an exception (an index out of bounds under
    NUMBA_BOUNDSCHECK, as CI's bounds-check stage runs them) and return 0
    where they return 1 when done: the kernels call them through
    ``simd._run``, which reports the failure (as it does a table entry left
    0, which it does not call), and raise then -- so that stage still
    fails."""
    import numpy as np
    from numba import carray, cfunc, njit, types

    from numkv._kernels.simd import LOOP_FAILED, _run

    @cfunc(types.int64(types.CPointer(types.float32), types.int64), boundscheck=True)
    def out_of_bounds(data, size):
        carray(data, size)[size] = 1.0  # one past the end
        return 1

    @cfunc(types.int64(types.CPointer(types.float32), types.int64), boundscheck=True)
    def in_bounds(data, size):
        carray(data, size)[size - 1] = 1.0
        return 1

    @njit
    def call(address, x):
        if _run(address, (x,)):
            raise RuntimeError(LOOP_FAILED)

    x = np.zeros(4, np.float32)
    call(in_bounds.address, x)
    assert x[3] == 1.0
    with pytest.raises(RuntimeError, match="stopped on an exception"):
        call(out_of_bounds.address, np.zeros(4, np.float32))
    with pytest.raises(RuntimeError, match="was not compiled"):  # a table entry left 0
        call(0, x)


def test_the_cycle_collector_is_paused_while_numkv_compiles_and_restored(monkeypatch):
    """``_config._GCPause``: off from the outermost compile of a numkv function
    to its end, then as it was -- on, or off where the user turned it off."""
    import gc
    import types as pytypes

    from numba.core import event

    from numkv import _config

    seen = []

    class Spy(event.Listener):
        def on_start(self, ev):
            if _config._is_numkv(ev):
                seen.append(gc.isenabled())

        def on_end(self, ev):
            pass

    def add_one(x):
        return x + 1

    monkeypatch.setattr(_config, "CACHE", False)  # (a function made here has no module file to cache by)
    _config.jit()  # numkv's listener first (numba calls listeners in order; alone, this test's came first)
    spy = Spy()
    event.register("numba:compile", spy)
    try:
        for user_enabled in (True, False):
            (gc.enable if user_enabled else gc.disable)()
            module = pytypes.FunctionType(add_one.__code__, {}, "add_one")
            module.__module__ = "numkv.test_only"  # a numkv function, compiled fresh each time
            kernel = _config.jit()(module)
            assert kernel(1.0 if user_enabled else 1) in (2, 2.0)
            assert gc.isenabled() == user_enabled
    finally:
        gc.enable()
        event.unregister("numba:compile", spy)
    assert seen and not any(seen)

    pause = _config._GCPause()
    with pause:
        with pause:
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
