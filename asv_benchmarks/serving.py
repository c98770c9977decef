"""Serving many requests at once (issue 42): ``numkv.varlen_attention`` and
``numkv.paged_attention`` over one packed batch of a continuous-batching
step -- a long prompt beside many one-token decodes, Hq 16, Hkv 4, head size
64 (transformers' serving workload, ``tools/serving_bench.py``) -- beside
the same sequences as one call each of ``numkv.attention`` (what the packed
calls must not cost much more than).

* ``mix``: ``prefill-1024+7x1-decode``: 1,024 prompt tokens and 7 decodes
  over 256-2,048 keys each (about ``tools/serving_bench.py``'s mix, shrunk);
  ``decode-8x1``: 8 decodes over 256-2,048 keys.
* ``paged``: the same keys in pages of 16, in a shuffled order.

Whole-model serving (``generate_batch`` against sdpa's) is
``tools/serving_bench.py``: minutes per run, too long for asv.
"""

import timeit

import numpy as np

from ._common import randn, reuse, skip_large

HQ, HKV, D = 16, 4, 64
MIXES = {
    "prefill-1024+7x1-decode": ((1024, 1024), (1, 256), (1, 512), (1, 768), (1, 1024), (1, 1280), (1, 1536),
                                (1, 2048)),
    "decode-8x1": ((1, 256), (1, 512), (1, 768), (1, 1024), (1, 1280), (1, 1536), (1, 1792), (1, 2048)),
}
PAGE = 16


def packed(mix):
    def make():
        lens_q = np.array([q for q, _ in MIXES[mix]])
        lens_k = np.array([k for _, k in MIXES[mix]])
        cu_q = np.concatenate([[0], np.cumsum(lens_q)])
        cu_k = np.concatenate([[0], np.cumsum(lens_k)])
        q = randn((int(cu_q[-1]), HQ, D), np.float32, seed=1)
        k = randn((int(cu_k[-1]), HKV, D), np.float32, seed=2, scale=D ** -0.25)
        v = randn((int(cu_k[-1]), HKV, D), np.float32, seed=3)
        # pages of PAGE keys in a shuffled order, each sequence's pages in its row of the table
        needed = -(-lens_k // PAGE)
        order = np.random.default_rng(4).permutation(int(needed.sum()))
        pool_k = np.zeros((len(order), PAGE, HKV, D), np.float32)
        pool_v = np.zeros_like(pool_k)
        table = np.full((len(lens_k), int(needed.max())), -1, np.int64)
        c = 0
        for i, n in enumerate(lens_k):
            for p in range(needed[i]):
                page, start = order[c], cu_k[i] + p * PAGE
                stop = min(cu_k[i] + n, start + PAGE)
                pool_k[page, :stop - start], pool_v[page, :stop - start] = k[start:stop], v[start:stop]
                table[i, p] = page
                c += 1
        return q, k, v, cu_q, cu_k, pool_k, pool_v, table, lens_k

    return reuse(("serving", mix), make)


class Serving:
    params = (list(MIXES), ["varlen", "paged", "one-call-each"])
    param_names = ["mix", "call"]
    timer = timeit.default_timer

    def setup(self, mix, call):
        skip_large(mix != "decode-8x1", "a 1024-token prefill")
        import numkv

        q, k, v, cu_q, cu_k, pool_k, pool_v, table, lens_k = packed(mix)
        if call == "varlen":
            self.run = lambda: numkv.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True)
        elif call == "paged":
            self.run = lambda: numkv.paged_attention(q, pool_k, pool_v, table, lens_k, cu_q, is_causal=True)
        else:
            views = [(q[cu_q[i]:cu_q[i + 1]].transpose(1, 0, 2)[None], k[cu_k[i]:cu_k[i + 1]].transpose(1, 0, 2)[None],
                      v[cu_k[i]:cu_k[i + 1]].transpose(1, 0, 2)[None], np.array([cu_k[i + 1] - cu_k[i]]))
                     for i in range(len(lens_k))]
            self.run = lambda: [numkv.attention(a, b, c, nonpad_kv_seqlen=n, is_causal=True) for a, b, c, n in views]
        self.run()

    def time_attention(self, mix, call):
        self.run()
