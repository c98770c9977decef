"""One decode step of a Llama-3.2-1B-shaped transformers model on the CPU:
sdpa + DynamicCache beside numkv + KVCache (float32, and q8_0 where numkv's
StaticKVCache takes it), and the attention call alone at transformers' GQA
shapes.

    python tools/hf_decode_step.py                      # both parts, 2k and 16k contexts
    python tools/hf_decode_step.py --part attention --contexts 2048 8192
    python tools/hf_decode_step.py --part step --contexts 2048 16384 --samples 7
    python tools/hf_decode_step.py --part attention --threads 1
    NUMBA_CACHE_DIR=$(mktemp -d) python tools/hf_decode_step.py --part first-call

The model: 16 layers, hidden 2048, 32 query / 8 key-value heads of 64,
intermediate 8192, as Llama-3.2-1B, but a vocabulary of 1024 (not 128256:
the embedding and the LM head would add 2 x 1 GiB of float32 weights that
every implementation reads alike), random weights, float32.  The caches are
filled by writing random keys and values through ``cache.update`` (a 16k
prefill would take hours on 2 cores), then each sample runs one token at
position ``context`` and crops the cache back by one.  Implementations
alternate sample by sample (one process, one model: the attention
implementation is switched on its config); medians.

The attention part: B=1, Hq=32, Hkv=8 (G=4), D=64, one query.  numkv reads
the cache's buffers in place (a prefix view with ``nonpad_kv_seqlen``, as
KVCache hands it, and a contiguous K/V); torch's SDPA runs packed GQA, as
transformers' sdpa does for one query when a mask is given: each kv head's
4 query heads on the query axis, one call, every kv head streamed once; and
``enable_gqa=True``, what transformers' sdpa takes on the CPU without a mask.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time

import numpy as np
import torch

import numkv
import numkv.transformers as nt


def _median_ms(samples):
    return 1e3 * statistics.median(samples)


def _time(fn, min_seconds):
    """Seconds per call of ``fn``: calls repeated for at least ``min_seconds``."""
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / n


def attention_part(contexts, samples, min_seconds):
    rng = np.random.default_rng(0)
    b, hq, hkv, d = 1, 32, 8, 64
    print(f"attention alone: B={b} Hq={hq} Hkv={hkv} D={d} one query, float32, {torch.get_num_threads()} torch "
          f"threads, {numkv.get_num_threads()} numkv threads; {samples} interleaved samples of >= {min_seconds} s, "
          f"medians")
    print("ratios: numkv's time over the faster torch variant's")
    print(f"{'context':>8} {'sdpa packed':>17} {'sdpa enable_gqa':>17} {'numkv contiguous':>17}"
          f" {'numkv KVCache view':>19} {'ratio':>6} {'ratio':>6}")
    for ctx in contexts:
        _attention_context(rng, ctx, b, hq, hkv, d, samples, min_seconds)


def _attention_context(rng, ctx, b, hq, hkv, d, samples, min_seconds):
    g = hq // hkv
    capacity = ctx + 64
    kbuf = rng.standard_normal((b, hkv, capacity, d), np.float32)
    vbuf = rng.standard_normal((b, hkv, capacity, d), np.float32)
    k, v = np.ascontiguousarray(kbuf[:, :, :ctx]), np.ascontiguousarray(vbuf[:, :, :ctx])
    q = rng.standard_normal((b, hq, 1, d), np.float32)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    packed = tq.reshape(b, hkv, g, d)  # transformers' pack_gqa
    nonpad = np.array([ctx], np.int64)

    def run_torch():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(packed, tk, tv)

    def run_gqa():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)

    def run_plain():
        numkv.attention(q, k, v)

    def run_view():
        numkv.attention(q, kbuf, vbuf, nonpad_kv_seqlen=nonpad, is_causal=True)

    y_t = torch.nn.functional.scaled_dot_product_attention(packed, tk, tv).reshape(b, hq, 1, d).numpy()
    for y in (numkv.attention(q, k, v), numkv.attention(q, kbuf, vbuf, nonpad_kv_seqlen=nonpad, is_causal=True)):
        assert np.abs(y - y_t).max() < 1e-5
    y_g = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True).numpy()
    assert np.abs(y_g - y_t).max() < 1e-5
    runs = {"torch": run_torch, "gqa": run_gqa, "plain": run_plain, "view": run_view}
    times = {name: [] for name in runs}
    for _ in range(samples):
        for name, fn in runs.items():
            times[name].append(_time(fn, min_seconds))
    t, tg, p, w = (_median_ms(times[n]) for n in runs)
    best = min(t, tg)
    print(f"{ctx:>8} {t * 1e3:>14.1f} us {tg * 1e3:>14.1f} us {p * 1e3:>14.1f} us {w * 1e3:>16.1f} us"
          f" {p / best:>5.2f}x {w / best:>5.2f}x")


def _model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=1024, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         max_position_embeddings=131072, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa",
                                             dtype=torch.float32)
    return model.eval()


def _fill(cache, model, ctx):
    """Write ``ctx`` random positions into every layer, in chunks."""
    cfg = model.config
    gen = torch.Generator().manual_seed(1)
    for layer in range(cfg.num_hidden_layers):
        for start in range(0, ctx, 4096):
            n = min(4096, ctx - start)
            k = torch.randn(1, cfg.num_key_value_heads, n, cfg.head_dim, generator=gen)
            v = torch.randn(1, cfg.num_key_value_heads, n, cfg.head_dim, generator=gen)
            cache.update(k, v, layer)


def _dynamic_bytes(cache):
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


class _Clock:
    """Seconds spent in the caches' ``update`` and in the attention
    functions during a step (wrappers of ~1 us a call)."""

    def __init__(self, names):
        from transformers import AttentionInterface

        self.update = self.attention = 0.0
        mapping = AttentionInterface._global_mapping
        for name in names:
            mapping[name] = self._timed(mapping[name], "attention")

    def _timed(self, fn, field):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - start)

        return timed

    def watch(self, cache):
        cache.update = self._timed(cache.update, "update")  # the instance's, which the model calls

    def reset(self):
        self.update = self.attention = 0.0


def step_part(contexts, samples):
    from transformers import DynamicCache

    name = nt.register()
    clock = _Clock(["sdpa", name])
    model = _model()
    impls = [("sdpa + DynamicCache", "sdpa", lambda ctx: DynamicCache(config=model.config)),
             ("numkv + KVCache float32", name, lambda ctx: nt.KVCache(model.config, 1, ctx + 8))]
    try:
        model.set_attn_implementation(name)  # (a quantised KVCache checks that numkv reads it)
        nt.KVCache(model.config, 1, 64, dtype="q8_0")
        impls.append(("numkv + KVCache q8_0", name, lambda ctx: nt.KVCache(model.config, 1, ctx + 8, dtype="q8_0")))
    except TypeError as exc:
        print(f"(q8_0 not measured: {exc})")
    print(f"decode step, Llama-3.2-1B shapes (vocab 1024), float32, {torch.get_num_threads()} torch threads, "
          f"{numkv.get_num_threads()} numkv threads; {samples} interleaved samples, medians")
    print("step: the whole forward; update: the caches' update (append / torch.cat); attention: the attention "
          "functions")
    print(f"{'context':>8} {'implementation':<26} {'step':>10} {'ratio':>6} {'update':>10} {'attention':>10}"
          f" {'cache bytes':>14}")
    for ctx in contexts:
        caches = []
        for label, impl, make in impls:
            model.set_attn_implementation(impl)
            cache = make(ctx)
            _fill(cache, model, ctx)
            clock.watch(cache)
            caches.append(cache)
        token = torch.tensor([[7]])
        position = torch.tensor([[ctx]])
        times, updates, attentions = ([[] for _ in impls] for _ in range(3))
        logits = [None] * len(impls)
        for sample in range(samples + 1):  # the first round warms up (compiles numkv)
            for i, ((label, impl, _), cache) in enumerate(zip(impls, caches)):
                model.set_attn_implementation(impl)
                assert model.config._attn_implementation == impl
                gc.collect()
                clock.reset()
                start = time.perf_counter()
                with torch.no_grad():
                    out = model(input_ids=token, position_ids=position, cache=cache, use_cache=True)
                elapsed = time.perf_counter() - start
                cache.crop(-1)
                assert cache.get_seq_length() == ctx
                logits[i] = out.logits
                if sample:
                    times[i].append(elapsed)
                    updates[i].append(clock.update)
                    attentions[i].append(clock.attention)
        base = _median_ms(times[0])
        for i, ((label, _, _), cache) in enumerate(zip(impls, caches)):
            nbytes = cache.nbytes if isinstance(cache, nt.KVCache) else _dynamic_bytes(cache)
            t = _median_ms(times[i])
            u, a = _median_ms(updates[i]), _median_ms(attentions[i])
            print(f"{ctx:>8} {label:<26} {t:>7.1f} ms {t / base:>5.2f}x {u:>7.1f} ms {a:>7.1f} ms {nbytes:>14,}")
        err = float((logits[1] - logits[0]).abs().max())
        print(f"{'':>8} max |logits numkv float32 - sdpa| = {err:.2e}")
        del caches
        gc.collect()


def first_call_part():
    """The first ``generate`` of a tiny Llama with a KVCache (prefill with a
    padding mask, decode steps, appends): numkv's kernels compile here.  Run
    with ``NUMBA_CACHE_DIR=$(mktemp -d)`` for the time from an empty cache."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    name = nt.register()
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                           cache=nt.KVCache(model.config, 2, 32))
        seconds.append(time.perf_counter() - start)
    print("first generate (tiny Llama, KVCache, left-padded batch of 2, 8 new tokens): "
          + ", then ".join(f"{s:.2f} s" for s in seconds))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["attention", "step", "both", "first-call"], default="both")
    parser.add_argument("--contexts", type=int, nargs="+", default=None)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=0.2, help="per attention sample")
    parser.add_argument("--threads", type=int, default=None, help="torch's and numkv's (default: theirs)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        numkv.set_num_threads(args.threads)
    if args.part == "first-call":
        first_call_part()
    if args.part in ("attention", "both"):
        attention_part(args.contexts or [2048, 8192], args.samples * 3, args.min_seconds)
    if args.part in ("step", "both"):
        step_part(args.contexts or [2048, 16384], args.samples)


if __name__ == "__main__":
    main()
