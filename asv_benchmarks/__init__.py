"""asv benchmarks for numkv (``asv run`` from the repo root; see asv.conf.json).

Modules: ``scatter`` (tensor_scatter and its peers), ``attention`` (attention
and its peers), ``caches`` (KV caches, the cached layer, the demo decoder's
tokens/s), ``memory`` (peak memory of a long prefill), ``startup`` (import and
first-call compile time).  ``NUMKV_BENCH_QUICK=1`` skips the large cases.
"""
