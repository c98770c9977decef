"""Environment switches (read once), the numba decorator factories, and the
wrappers' tunables.

Nothing here imports numba at module import time: ``import numkv`` must stay
cheap, so the kernels (and numba with them) are imported on the first call.

Switches
--------
NUMKV_CACHE
    ``1`` (default) keeps compiled kernels in numba's on-disk cache, ``0`` turns
    the disk cache off.  Where the package directory is read-only numba falls
    back to its per-user cache directory (``NUMBA_CACHE_DIR`` overrides it);
    where no location is writable the kernels are compiled in memory only.
NUMKV_REFERENCE
    ``1`` routes every op through its plain NumPy reference path (``REFERENCE``).
NUMKV_SPIN_US
    How long the pool's workers spin after close calls (``SPIN_US`` when
    unset); read by ``_runtime.pool`` when it makes its control block, not here.
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


# --------------------------------------------------------------------------
# Tunables
#
# The wrappers' tile, thread and copy policy: plain numbers that change how
# fast a call runs, never what it returns.  The modules read them at call
# time as ``_config.NAME`` (never ``from ._config import NAME``, which would
# freeze a copy), so that a test overrides one here:
# ``monkeypatch.setattr(_config, "THREAD_MACS", 0)``.  Each says why and the
# figure that decided; the measurement logs are in docs/performance.md.  What
# a call derives from them may be kept per layout: ``_attention._plans``
# (keyed by the thread thresholds below; the tile sizes are not in its key,
# nor in packed calls' ``_layouts``: tests/conftest.py empties both before
# each test, and a test that changes a tile tunable after a call empties
# them too) and ``_scatter``'s ``_appends``
# / ``_layouts`` (work items of ``CHUNK_BYTES``; an in-place append's
# batch-1 and one-token routes, taken below ``PARALLEL_MIN_BYTES``).  The
# kernels' compile-time constants (``_kernels``: ``AXPY_KEYS``, ...; the
# protocol's ``JOIN_SPIN_NS``) stay beside their code: numba and llvmlite
# bake them into machine code.

# numkv.attention: the tile and thread policy (the measurements that set
# each constant: docs/performance.md, "The tile and thread policy's
# measurements").  A work item scores ``G * block_q`` query rows against
# ``block_k`` keys a tile.
# * Prefill (>= ``GEMM_MIN_ROWS`` rows): matrix-product tiles of 256 rows x
#   512 keys, long enough to spread the softmax's per-row work, small enough
#   for an L2; the rows halve (to ``MIN_ROWS_PER_TILE``) while there are
#   fewer than ``TARGET_GEMM_ITEMS`` tiles.
# * Decode: the loop kernel, ``LOOP_BLOCK_K`` keys a tile (fewer, longer
#   tiles: 1-7% faster than 128).
# * Few work items: the keys split into chunks of at least ``MIN_CHUNK`` for
#   ``TARGET_ITEMS`` items, by the shapes only (Y never depends on the thread
#   count); calls under ``SPLIT_MACS`` keep them whole (a merge costs more).
# * Threads: calls under ``SINGLE_THREAD_MACS`` stay on the caller, but for
#   those from ``HOT_THREAD_MACS`` when calls come back to back (a worker is
#   then awake: 1.2-1.7x, where after a gap its wake costs more than it
#   saves); larger ones take one thread per ``THREAD_MACS`` (16 Intel
#   cores, the old pool: more threads were slower below that).
GEMM_MIN_ROWS = 16
ROWS_PER_TILE, MIN_ROWS_PER_TILE, GEMM_BLOCK_K = 256, 128, 512
LOOP_BLOCK_K = 256
TARGET_ITEMS, TARGET_GEMM_ITEMS = 256, 64
MIN_CHUNK = 512
# (SINGLE_THREAD_MACS 2**21 until AVX2's decode took 0.6-0.75x its time: then
# the decodes of 2**21 multiply-adds after a 1 ms gap took 0.81-0.90x as long
# on 1 thread as on 2, a 2-vCPU Zen 3; 2**22 keeps them on the caller then.)
SINGLE_THREAD_MACS, SPLIT_MACS, THREAD_MACS = 1 << 22, 1 << 23, 1 << 22  # THREAD_MACS 0: no limit (tests)
HOT_THREAD_MACS = 1 << 19  # from here to SINGLE_THREAD_MACS, two threads where the workers are awake
GIL_MACS = 1 << 26  # multiply-adds a thread, above which a call lets go of the GIL (``_attention._releases_gil``)
# Threads claim work items one at a time rather than take equal shares: a
# worker that wakes late or runs slow then takes fewer (2 threads, medians of
# interleaved calls: 1.01-1.06x faster decode, Skv 512-16384 and B=8; 1.09x
# causal prefill S=2048; never slower).  Tests turn it off to split items
# over threads in a known way.
CLAIM_ITEMS = True
# A float16 Y of at least this many elements is narrowed by numkv's kernel
# (``_attention._to_float16``), a smaller one by NumPy's cast.
NARROW_MIN = 1 << 16
# At most this many plans kept (``_attention._plans``; as many layouts,
# ``_layouts``, checks, ``_checks``, and decode steps' plans, ``_step_plans``,
# of packed calls and of calls over a cache's views), the oldest dropped
# first: the layers of a decode step share a few; the bound caps what a run
# of new shapes keeps.
PLANS_KEPT = 64

# numkv.tensor_scatter.
# Below this many bytes moved the serial kernel wins: the parallel launch
# costs more than the copy itself (see README, "Benchmarks").
PARALLEL_MIN_BYTES = 1 << 18
# From this many bytes moved a copy lets other Python threads run meanwhile
# (``_runtime.pool``): ~5 ms, Python's switch interval, at the ~10 GB/s a
# thread copies.
RELEASE_GIL_BYTES = 1 << 25
# Positions per work item: ~64 KiB each, so a long copy spreads over the
# threads while a 1-token append stays one item per row.
CHUNK_BYTES = 1 << 16

# numkv's pool (``_runtime.pool``): waking a sleeping worker costs tens of
# microseconds on a VM, a good part of a small call (docs/performance.md,
# the resident workers' figures), so a worker whose jobs come close
# together spins a while for the next; one called now and then never spins.
# (Read as the pool is made and as it makes its control block: a change
# here reaches a pool made after it.)
SPIN_US = 100  # how long a worker whose jobs come close together spins for the next (NUMKV_SPIN_US)
CLOSE_US = 2000  # jobs this close together are "close"
