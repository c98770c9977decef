"""Say so before numba compiles one of numkv's kernels.

A kernel's first call in a fresh process either loads it from numba's disk
cache (0.03-0.8 s) or, when the cache is cold, compiles it (10-20 s for
attention's kernel of each accumulation dtype on 2 cores): a long silence
unless someone says what is happening.  ``compile_notice`` listens for
numba's ``"numba:compile"`` event, which numba fires only when it really
compiles (after a disk-cache miss, never on a load), and prints its line
*before* the compiler starts::

    with compile_notice("float32 attention", seconds=15):
        numkv.attention(q, k, v)

    compiling numkv's kernels for float32 attention (first run only, ~15 s) ... 14.2 s

It relies on nothing but the kernels living in numkv's modules: neither
their number nor their names.  The command line (demo, bench, warmup) uses
it; the library itself never prints.
"""

import contextlib
import sys
import threading
import time

HINT = "`python -m numkv warmup` compiles every kernel ahead of time"


def is_numkv_kernel(dispatcher):
    """Whether a numba dispatcher compiles one of numkv's own functions."""
    module = getattr(getattr(dispatcher, "py_func", None), "__module__", "") or ""
    return module == "numkv" or module.startswith("numkv.")


class CompileWatch:
    """Counts the numkv kernels numba compiles while installed; the first one
    triggers ``on_first()``.  Only the outermost compile counts: a kernel's
    helpers compile inside it."""

    def __init__(self, on_first=None, owns=is_numkv_kernel):
        self.on_first, self.owns = on_first, owns
        self.compiled = 0        # outermost numkv kernels compiled
        self.kernels = []        # their "name(argument types)"
        self.started = None      # perf_counter() at the first compile
        self._depth = 0
        self._lock = threading.Lock()

    # numba.core.event.Listener's interface (duck-typed: see _install)
    def notify(self, event):
        dispatcher = (event.data or {}).get("dispatcher")
        if not self.owns(dispatcher):
            return
        with self._lock:
            if event.is_start:
                self._depth += 1
                first = self._depth == 1 and self.compiled == 0
                if self._depth == 1:
                    self.compiled += 1
                    args = ", ".join(map(str, (event.data or {}).get("args", ())))
                    self.kernels.append(f"{dispatcher.py_func.__qualname__}({args})")
            else:
                self._depth -= 1
                first = False
        if first:
            self.started = time.perf_counter()
            if self.on_first is not None:
                self.on_first()

    @contextlib.contextmanager
    def installed(self):
        """Listen for numba's compile events inside the block."""
        from numkv._kernels.compiler import listen_for_compiles

        stop = listen_for_compiles(self.notify)
        try:
            yield self
        finally:
            stop()


@contextlib.contextmanager
def compile_notice(what, seconds=10, stream=None, hint=True):
    """Around a first call: if numba starts compiling a numkv kernel inside
    the block, print ``compiling numkv's kernels for <what> (first run only,
    ~<seconds> s)`` before it does, and the time it took at the end.  Silent
    when every kernel comes from the disk cache.

    ``seconds`` is the caller's estimate (measured on 2 cores); ``hint``
    adds, once per process, how to compile everything ahead of time.
    Yields the ``CompileWatch`` (``.compiled``: kernels compiled).
    """
    stream = sys.stderr if stream is None else stream

    def announce():
        tail = f"; {HINT}" if hint and not _hinted.is_set() else ""
        _hinted.set()
        stream.write(f"compiling numkv's kernels for {what} (first run only, ~{seconds:.0f} s{tail}) ... ")
        stream.flush()

    watch = CompileWatch(on_first=announce)
    try:
        with watch.installed():
            yield watch
    finally:  # end the line even when the call fails
        if watch.compiled:
            stream.write(f"{time.perf_counter() - watch.started:.1f} s\n")
            stream.flush()


_hinted = threading.Event()
