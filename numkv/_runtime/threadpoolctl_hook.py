"""numkv as a thread pool that ``threadpoolctl`` sees and limits.

``threadpool_limits(limits=1)`` (Dask, joblib, scikit-learn use it) caps every
pool threadpoolctl knows; registering a controller (threadpoolctl >= 3.5)
puts numkv among them.  threadpoolctl finds pools through the shared libraries
loaded in the process, and numkv, pure Python, has none of its own: its
controller is tied to ml_dtypes' extension, which ``import numkv`` always
loads (so ``threadpool_info()`` lists numkv with that file as its
``filepath``).  Registering costs ``import numkv`` 3-7 ms (measured).
"""

import threadpoolctl

from .._version import __version__
from . import thread_count


class NumkvController(threadpoolctl.LibController):
    """numkv's process-wide thread count (``numkv.set_num_threads``)."""

    user_api = "numkv"
    internal_api = "numkv"
    filename_prefixes = ("_ml_dtypes_ext",)

    def get_num_threads(self):
        return thread_count.get_num_threads()

    def set_num_threads(self, num_threads):
        thread_count.set_num_threads(num_threads)

    def get_version(self):
        return __version__


threadpoolctl.register(NumkvController)
