"""Serving on a CPU through transformers: continuous batching
(``model.generate_batch``) on numkv against sdpa, and one request after
another (``model.generate``) -- issue 42's workload.

A Llama-shaped decoder with random weights (no download): 8 layers, 16 query
/ 4 key-value heads of 64, 8 requests of 256-2,048 prompt tokens (8,320 in
all), 16 new tokens each, greedy; torch and numkv on the same thread count.
Prints wall time, requests/s and generated tokens/s per mode, and checks
that every mode generates the same tokens as sdpa's ``generate_batch``.

    python tools/serving_bench.py                       # the issue's workload, 2 threads
    python tools/serving_bench.py --modes numkv-batch sdpa-batch --concurrency 1 4 16
    python tools/serving_bench.py --quick               # 2 layers, short prompts: a smoke run

``--concurrency N`` caps the requests a continuous batch holds at once
(``ContinuousBatchingConfig.max_requests_per_batch``); one-by-one modes ignore it.
``--modes floor-batch floor-one-by-one``: numkv's modes with every attention
call answered by zeros of its shape, the model's other work unchanged (its
tokens differ): what a mode would take if attention cost nothing, the floor
below which no attention can bring it.
``--cache-tokens N`` gives every ``generate_batch`` (sdpa's too) a paged cache of
N tokens; without it numkv's gets ``numkv.transformers.continuous_batching``'s
default and sdpa's transformers' own (90% of the free memory, zeroed per call).
"""

import argparse
import contextlib
import copy
import os
import sys
import time

MODES = ("sdpa-batch", "numkv-batch", "sdpa-one-by-one", "numkv-one-by-one")
FLOOR_MODES = ("floor-batch", "floor-one-by-one")  # numkv's modes with attention returning zeros
PROMPTS = (256, 512, 768, 1024, 1280, 1408, 1024, 2048)  # 8,320 tokens


def build(impl, layers, vocab):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=vocab, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl).eval()


def run_batch(model, prompts, new, concurrency, cache_tokens=None):
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    settings = {}
    if concurrency:
        settings["max_requests_per_batch"] = concurrency
    if cache_tokens:
        settings["num_blocks"] = -(-cache_tokens // ContinuousBatchingConfig().page_size)
    cb = ContinuousBatchingConfig(**settings) if settings else None
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=cb,
                                   progress_bar=True)
        elapsed = time.perf_counter() - start
    return elapsed, [list(out[f"req_{i}"].generated_tokens) for i in range(len(prompts))]


def run_one_by_one(model, prompts, new):
    import torch
    from tqdm import tqdm

    tokens = []
    with torch.no_grad():
        start = time.perf_counter()
        for prompt in tqdm(prompts, desc="one by one", unit="request"):
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=0)
            tokens.append(out[0, len(prompt):].tolist())
        elapsed = time.perf_counter() - start
    return elapsed, tokens


@contextlib.contextmanager
def attention_free(numkv):
    """numkv's attention and varlen_attention answer zeros of their output's
    shape (Q's, with V's head size) for as long as the block runs."""
    import numpy as np

    def zeros(q, k, v, *args, **kwargs):
        return np.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)

    saved = numkv.attention, numkv.varlen_attention
    numkv.attention = numkv.varlen_attention = zeros
    try:
        yield
    finally:
        numkv.attention, numkv.varlen_attention = saved


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--modes", nargs="+", choices=MODES + FLOOR_MODES, default=list(MODES))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[0],
                        help="requests a continuous batch holds at once (0: transformers' default)")
    parser.add_argument("--cache-tokens", type=int, default=0,
                        help="every generate_batch's paged cache, in tokens (0: each implementation's default)")
    parser.add_argument("--quick", action="store_true", help="2 layers, prompts of 32-256 tokens, 4 new")
    args = parser.parse_args(argv)
    prompts_len, layers, new = PROMPTS, args.layers, args.new
    if args.quick:
        prompts_len, layers, new = tuple(n // 8 for n in PROMPTS), 2, 4

    import torch

    import numkv
    import numkv.transformers as nt

    torch.set_num_threads(args.threads)
    numkv.set_num_threads(args.threads)
    name = nt.register()
    g = torch.Generator().manual_seed(42)
    prompts = [torch.randint(1, args.vocab, (n,), generator=g).tolist() for n in prompts_len]
    print(f"# {layers} layers, 16/4 heads x 64, {len(prompts)} requests of {min(prompts_len)}-{max(prompts_len)} "
          f"prompt tokens ({sum(prompts_len)} in all), {new} new each, {args.threads} threads; "
          f"torch {torch.__version__}, numkv {numkv.__version__}; paged cache: "
          f"{args.cache_tokens or 'each default'} tokens; load: {os.getloadavg()[0]:.2f}", flush=True)

    models = {}

    def model(impl):
        if impl not in models:
            models[impl] = build(impl, layers, args.vocab)
        return models[impl]

    # warm-up: numkv's kernels compile on first use, transformers' CB machinery starts
    warm = [p[:64] for p in prompts[:2]]
    run_batch(model("sdpa"), warm, 2, 0)
    m = model(name)
    nt.continuous_batching(m)
    run_batch(m, warm, 2, 0)
    rows, reference = [], None
    for mode in args.modes:
        impl = "sdpa" if mode.startswith("sdpa") else name
        for concurrency in (args.concurrency if mode.endswith("batch") else [0]):
            m = model(impl)
            with attention_free(numkv) if mode in FLOOR_MODES else contextlib.nullcontext():
                if mode.endswith("batch"):
                    elapsed, tokens = run_batch(m, prompts, new, concurrency, args.cache_tokens)
                else:
                    elapsed, tokens = run_one_by_one(m, prompts, new)
            if mode == "sdpa-batch" and reference is None:
                reference = tokens
            same = "" if reference is None else ("same tokens" if tokens == reference else "TOKENS DIFFER")
            if mode in FLOOR_MODES:
                same = "(attention answered zeros)"
            label = f"{mode}" + (f" (concurrency {concurrency})" if concurrency else "")
            rows.append((label, elapsed, len(prompts) / elapsed, len(prompts) * new / elapsed, same))
            print(f"{label}: {elapsed:.2f} s {same}", flush=True)
    print()
    print("| mode | time (s) | requests/s | generated tokens/s | vs sdpa's tokens |")
    print("|---|---|---|---|---|")
    for label, elapsed, rps, tps, same in rows:
        print(f"| {label} | {elapsed:.2f} | {rps:.3f} | {tps:.2f} | {same} |")
    print(f"# load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
