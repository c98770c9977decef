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
# softmax relies on -inf (see STYLE.md, "fastmath").
FASTMATH = frozenset({"reassoc", "contract"})


def jit(reassociate=False, contract=False, inline=False):
    """A lazy ``numba.njit`` (no signatures: nothing compiles at import);
    ``reassociate`` enables exactly the ``FASTMATH`` flags, ``contract`` only
    the fusing of a multiply and an add into one FMA (no reordering);
    ``inline`` inlines a small helper into its callers (no call, no reference
    counting of its array arguments)."""
    import numba

    options = dict(nogil=True, error_model="numpy")
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
    address (``_kernels.simd._call``), compiled on its own; ``contract`` as
    ``jit``'s."""
    import numba

    options = dict(error_model="numpy")
    if contract:
        options["fastmath"] = {"contract"}

    def decorate(func):
        if CACHE:
            try:
                return numba.cfunc(signature, cache=True, **options)(func)
            except RuntimeError:  # no writable cache locator (read-only install)
                pass
        return numba.cfunc(signature, **options)(func)

    return decorate


# Tests set this to route every op through its plain NumPy reference path.
REFERENCE = os.environ.get("NUMKV_REFERENCE", "0") == "1"

