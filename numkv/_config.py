"""Environment switches (read once) and the numba decorator factories.

Nothing here imports numba at module import time: ``import numkv`` must stay
cheap, so the kernels (and numba with them) are imported on the first call.

Switches
--------
NUMKV_CACHE
    ``1`` (default) keeps compiled kernels in numba's on-disk cache, ``0`` turns
    the disk cache off.  Where the package directory is read-only numba falls
    back to its per-user cache directory (``NUMBA_CACHE_DIR`` overrides it);
    where no location is writable the kernels are compiled in memory only.
"""

import os

CACHE = os.environ.get("NUMKV_CACHE", "1") != "0"

# Vectorised reductions need reassociation; never "nnan"/"ninf": the online
# softmax relies on -inf (a masked key's score; with "ninf" LLVM may fold its
# exp and the max against it away).
FASTMATH = frozenset({"reassoc", "contract"})


class _GCPause:
    """Python's cycle collector off while numba compiles a numkv function,
    then back as it was: numba's compiler builds and deep-copies hundreds of
    thousands of IR objects, and every few thousand allocations the
    collector walks all of them -- 0.5-0.7 s of a cold first call that took
    ~6.3 s then (2-core EPYC).  Nested pauses (a kernel compiling its
    callees) restore it at the outermost end.  Used as a context manager (``c_function``) and
    as a listener of numba's compile events (``jit``'s kernels: installed
    with the first).  A collector the user turned off stays off."""

    def __init__(self):
        import threading

        self.depth, self.was_enabled, self._lock = 0, False, threading.Lock()

    def __enter__(self):
        import gc

        with self._lock:  # (two threads may compile at once: numkv's C functions, another kernel)
            if self.depth == 0:
                self.was_enabled = gc.isenabled()
                gc.disable()
            self.depth += 1

    def __exit__(self, *exc):
        import gc

        with self._lock:
            self.depth -= 1
            if self.depth == 0 and self.was_enabled:
                gc.enable()

    def listen(self):
        from numba.core import event

        pause = self

        class _Listener(event.Listener):
            def on_start(self, ev):
                if _is_numkv(ev):
                    pause.__enter__()

            def on_end(self, ev):
                if _is_numkv(ev):
                    pause.__exit__()

        event.register("numba:compile", _Listener())


def _is_numkv(ev):
    """Whether a compile event is for one of numkv's functions."""
    py_func = getattr(ev.data["dispatcher"], "py_func", None)
    return getattr(py_func, "__module__", "").startswith("numkv.")


_gc_pause = _GCPause()
_listening = []


def jit(reassociate=False, contract=False, inline=False, release_gil=False):
    """A lazy ``numba.njit`` (no signatures: nothing compiles at import);
    ``reassociate`` enables exactly the ``FASTMATH`` flags, ``contract`` only
    the fusing of a multiply and an add into one FMA (no reordering);
    ``inline`` inlines a small helper into its callers (no call, no reference
    counting of its array arguments).  A kernel keeps its caller's GIL
    (beside a busy Python thread, taking it back after a call costs up to
    Python's switch interval, 5 ms); a long call on the pool lets go of it
    itself (``_runtime.protocol``); ``release_gil``: numba's ``nogil``, for
    the pool's workers, which never come back."""
    import numba

    if not _listening:
        _gc_pause.listen()
        _listening.append(True)
    options = dict(nogil=release_gil, error_model="numpy")
    if reassociate:
        options["fastmath"] = set(FASTMATH)
    elif contract:
        options["fastmath"] = {"contract"}
    if inline:
        options["inline"] = "always"

    def decorate(func):
        if CACHE:
            try:
                return numba.njit(cache=True, **options)(func)
            except RuntimeError:  # no writable cache locator (read-only install)
                pass
        return numba.njit(**options)(func)

    return decorate


def c_function(signature, contract=False):
    """A ``numba.cfunc`` of ``signature`` (compiled now, kept in the disk
    cache as ``jit``'s kernels are): a function jitted code calls by its
    address (``_kernels.simd._run``), compiled on its own; ``contract`` as
    ``jit``'s.  Where it really compiles (not on a disk-cache load) it fires
    numba's ``"numba:compile"`` event, as a jitted kernel does, which numba
    does not for a cfunc: the command line's compile notice and ``warmup``
    then see it."""
    from numba.core import event, sigutils
    from numba.core.ccallback import CFunc

    options = dict(error_model="numpy")
    if contract:
        options["fastmath"] = {"contract"}

    def decorate(func):
        function = CFunc(func, sigutils.normalize_signature(signature), locals={}, options=options)
        if CACHE:
            try:
                function.enable_caching()
            except RuntimeError:  # no writable cache locator (read-only install)
                pass
        compile_uncached = getattr(function, "_compile_uncached", None)  # called only where the cache misses
        if compile_uncached is not None:  # (numba's internals: without it, no event, nothing else lost)
            seen_as = _Compiled(func)

            def announced():
                with event.trigger_event("numba:compile", data={"dispatcher": seen_as, "args": signature.args,
                                                                "return_type": signature.return_type}):
                    return compile_uncached()

            function._compile_uncached = announced
        with _gc_pause:  # (around the cache's lookup and save too)
            function.compile()
        return function

    return decorate


class _Compiled:
    """What a compile event names for a ``c_function``: its Python function
    (``py_func``, as a dispatcher's)."""

    def __init__(self, py_func):
        self.py_func = py_func


# Tests set this to route every op through its plain NumPy reference path.
REFERENCE = os.environ.get("NUMKV_REFERENCE", "0") == "1"

