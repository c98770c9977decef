"""How numkv launches its kernels: the one place that decides thread counts.

Every compiled kernel comes as a pair: a ``parallel`` build (numba ``prange``
over work items) and a ``serial`` twin of the same body.  The wrappers call
``launch`` and never touch numba's threading themselves.
"""


def launch(parallel, serial, args, small=False):
    """Run ``parallel(*args)`` (or its ``serial`` twin).

    ``small``: the call's work is below the threshold where a parallel launch
    costs more than it saves; it runs on one thread.  The serial twin is
    compiled only where it is needed, so a small call limits the parallel
    kernel to one thread rather than compiling a second kernel.
    """
    if not small:
        parallel(*args)
        return
    import numba

    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        parallel(*args)
    finally:
        numba.set_num_threads(threads)
