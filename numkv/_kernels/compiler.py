"""numba's compiler seen from outside the kernels: its compile events and its
disk cache's index.  The command line (the first-compile notice, ``warmup``)
uses these; they live here because only ``numkv._kernels`` and the jit factory
(``numkv._config``) import numba."""


def listen_for_compiles(notify):
    """Call ``notify(event)`` on each start and end of a numba compilation
    (``"numba:compile"``, fired only when numba really compiles, never on a
    disk-cache load); returns the function that stops listening."""
    from numba.core import event

    class _Forward(event.Listener):
        def on_start(self, ev):
            notify(ev)

        def on_end(self, ev):
            notify(ev)

    listener = _Forward()
    event.register("numba:compile", listener)
    return lambda: event.unregister("numba:compile", listener)


def cache_index_file():
    """numba's on-disk cache index class (``IndexDataCacheFile``, whose
    ``save`` rewrites a function's whole index), or None in a numba that
    lacks it."""
    try:
        from numba.core import caching
    except ImportError:  # pragma: no cover - numkv needs numba >= 0.60
        return None
    index = getattr(caching, "IndexDataCacheFile", None)
    return index if index is not None and hasattr(index, "save") else None
