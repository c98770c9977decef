"""numba kernels. Only this package (and ``_config``) imports numba."""
