"""``python -m numkv demo``: greedy decoding of a small decoder, with and without
KV caches; checks that they agree and prints tokens per second.

Five runs over the same ragged batch of random prompts (public API only):

(a) no cache: every step recomputes the whole prefix (the reference);
(b) ``DynamicKVCache``; (c) ``StaticKVCache`` float32 — both must give (a)'s
    tokens and, to float tolerance, its logits (exit status 1 if not);
(d) a ``StaticKVCache`` in a low-precision dtype (bfloat16 by default) or a
    quantised format (``--kv-dtype``, one of ``numkv.quantize``'s block
    formats: blocks of 32 along the head, so the decoder's head size must be
    a multiple of 32 — the default size is then ``base``, the smallest preset
    with one), its values in ``--v-dtype`` where given (keys and values in
    different formats, as llama.cpp's ``-ctk`` / ``-ctv``); its token
    agreement with (c), the float32 cache, and its logit drift from it are
    reported;
(e) a circular ``StaticKVCache`` with a sliding window, prefilled in chunks that
    wrap around the ring: checked against (a') a no-cache recompute with the
    same window (``left_window_size``).
"""

import sys
import time

import numpy as np

import numkv
from numkv import _formats

# Logits agree when |a - b| <= ATOL + RTOL * max|a|: float32 sums taken in a
# different order (one-shot vs cached, different tile splits) differ by a few
# ulps per layer; the measured gap at every preset is ~1e-6 of the logit scale.
RTOL = 1e-4
ATOL = 1e-4

# numkv.quantize's block formats: the cache quantises each token's blocks of
# 32 head elements on append (numkv.StaticKVCache(..., dtype=<format>)).
QUANTIZED = _formats.BLOCK_FORMATS
KV_DTYPES = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", *QUANTIZED)
BLOCK = 32
SIZES = ("tiny", "small", "base")
DEFAULT_SIZE = "small"


def add_parser(subparsers):
    p = subparsers.add_parser(
        "demo", help="greedy decoding with and without KV caches: agreement and tokens/s",
        description=__doc__.split("\n\n")[0])
    from numkv._cli.options import MAX_WORKERS, count

    p.add_argument("--batch", type=count(1), default=4, metavar="N", help="prompts in the batch (default 4)")
    p.add_argument("--prompt-len", type=count(1), default=64, metavar="N",
                   help="longest prompt; the others are shorter, down to half (default 64)")
    p.add_argument("--new-tokens", type=count(1), default=32, metavar="N",
                   help="tokens generated per prompt (default 32)")
    p.add_argument("--size", default=None, choices=SIZES,
                   help=f"decoder preset (default {DEFAULT_SIZE}; with a quantised --kv-dtype, "
                        f"{_quantized_size()}: the smallest whose head size {BLOCK} divides)")
    p.add_argument("--threads", type=count(1, MAX_WORKERS), default=None, metavar="N",
                   help="numkv's threads (default: numkv's, one per core)")
    p.add_argument("--kv-dtype", default="bfloat16", choices=KV_DTYPES,
                   help=f"dtype of the low-precision cache (d), or a quantised format ({', '.join(QUANTIZED)}: "
                        f"blocks of 32, so a head size 32 divides) (default bfloat16)")
    p.add_argument("--v-dtype", default=None, choices=KV_DTYPES,
                   help="the values' own dtype or format in cache (d) (default: --kv-dtype's), e.g. "
                        "--kv-dtype q8_0 --v-dtype q4_0")
    p.add_argument("--window", type=count(1), default=None, metavar="N",
                   help="sliding window of the circular cache (e) (default prompt-len // 2)")
    p.add_argument("--seed", type=count(0), default=0, metavar="N",
                   help="weights and prompts seed, >= 0 (default 0)")
    p.set_defaults(run=run, check=check, parser=p)
    return p


def _head_dim(size):
    from numkv.layers import PRESETS

    return PRESETS[size]["embed_dim"] // PRESETS[size]["num_heads"]


def _quantized_size():
    """The smallest preset whose head size the quantised formats' block divides."""
    return next(size for size in SIZES if _head_dim(size) % BLOCK == 0)


def _size(args):
    """``--size``, or its default for ``--kv-dtype``."""
    if args.size is not None:
        return args.size
    return _quantized_size() if _quantized_option(args) else DEFAULT_SIZE


def _quantized_option(args):
    """``(option, format)`` of the first quantised ``--kv-dtype`` / ``--v-dtype``, or None."""
    for option, name in (("--kv-dtype", args.kv_dtype), ("--v-dtype", getattr(args, "v_dtype", None))):
        if name in QUANTIZED:
            return option, name
    return None


def check(args):
    """What is wrong with the options together (None: nothing)."""
    quantized = _quantized_option(args)
    if quantized and args.size is not None and _head_dim(args.size) % BLOCK:
        option, name = quantized
        return (f"{option} {name} quantises blocks of {BLOCK} along the head, but --size "
                f"{args.size} has head size {_head_dim(args.size)}: use --size {_quantized_size()} "
                f"(head size {_head_dim(_quantized_size())}), or leave --size out")
    return None


def _dtype(name):
    """A NumPy dtype, or a quantised format's name (the cache's ``dtype``)."""
    if name in QUANTIZED:
        return name
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name, None) or name)


class _Progress:
    """A one-line progress bar on stderr, drawn only on a terminal."""

    def __init__(self, label, stream=None):
        self.label = label
        self.stream = sys.stderr if stream is None else stream  # looked up now: tests swap it
        self.live = hasattr(self.stream, "isatty") and self.stream.isatty()

    def __call__(self, done, total):
        if self.live:
            bar = "#" * (20 * done // total)
            self.stream.write(f"\r  {self.label:<34} [{bar:<20}] {done}/{total}")
            self.stream.flush()

    def close(self):
        if self.live:
            self.stream.write("\r" + " " * 72 + "\r")
            self.stream.flush()


def _first_compile(label):
    """What a run's first call may compile, and about how long that takes from
    a cold cache (measured on 2 cores: ~4 s for the first run's float32
    attention, prefill and decode, whose kernel every later run reuses; ~1.5-2
    s for a cache's writes and another cache dtype's loops)."""
    if label.startswith("(a)"):
        return f"run {label}: float32 attention", 4
    return f"run {label}", 2


def _timed(decoder, prompts, new_tokens, label, **kwargs):
    progress = _Progress(label)
    start = time.perf_counter()
    try:
        tokens, logits = decoder.generate(prompts, new_tokens, progress=progress, **kwargs)
    finally:
        progress.close()
    return tokens, logits, time.perf_counter() - start


def _same_prefix(tokens, ref):
    """``[b, t]``: row ``b`` chose the same tokens as ``ref`` before step ``t``,
    so the logits at step ``t`` are comparable."""
    equal = tokens == ref
    prefix = np.ones_like(equal)
    prefix[:, 1:] = np.cumprod(equal[:, :-1], axis=1).astype(bool)
    return prefix


def _drift(tokens, logits, ref_tokens, ref_logits):
    """A lossy cache's drift from a reference run, as one line: the tokens
    equal to the reference's (position by position) and the largest logit
    difference before the rows diverge, absolute and as a fraction of the
    reference's largest logit (the scale greedy choices are made on)."""
    _, _, worst, n_equal = _compare(tokens, logits, ref_tokens, ref_logits)
    scale = float(np.abs(ref_logits).max()) if ref_logits.size else 0.0
    relative = f" = {worst / scale:.2%} of max |logit| {scale:.3g}" if scale else ""
    return (f"{n_equal}/{tokens.size} tokens equal ({n_equal / max(tokens.size, 1):.1%}), "
            f"max |dlogit| {worst:.2e}{relative} (before divergence)")


def _compare(tokens, logits, ref_tokens, ref_logits):
    """Compare a run with a reference run.

    Returns ``(agree, note, worst, n_equal)``: logits are compared where both
    runs had chosen the same tokens so far (``worst`` = max |difference|).
    Tokens must be equal, except that a row may diverge at a near-tie: where
    the reference's two candidates are within the logits tolerance, either
    choice is right, and the rows are compared up to there.
    """
    prefix = _same_prefix(tokens, ref_tokens)
    diff = np.abs(logits.astype(np.float64) - ref_logits)[prefix]
    worst = float(diff.max()) if diff.size else 0.0
    tol = ATOL + RTOL * (float(np.abs(ref_logits).max()) if ref_logits.size else 0.0)
    n_equal = int((tokens == ref_tokens).sum())
    ties = []
    for b, t in zip(*np.nonzero(prefix & (tokens != ref_tokens))):
        gap = abs(float(ref_logits[b, t, ref_tokens[b, t]]) - float(ref_logits[b, t, tokens[b, t]]))
        if gap > tol:
            return False, f"tokens differ (row {b}, step {t})", worst, n_equal
        ties.append(f"row {b} step {t}")
    if worst > tol:
        return False, "logits differ", worst, n_equal
    note = "tokens equal" if not ties else "tokens equal up to near-ties at " + ", ".join(ties)
    return True, note, worst, n_equal


def run(args):
    from numkv._cli.compile_notice import compile_notice
    from numkv.layers import Decoder

    if args.threads is not None:
        numkv.set_num_threads(args.threads)
    if min(args.batch, args.prompt_len, args.new_tokens) < 1:
        raise SystemExit("demo: --batch, --prompt-len and --new-tokens must be >= 1")
    window = max(1, args.prompt_len // 2) if args.window is None else args.window
    kv_dtype = _dtype(args.kv_dtype)
    v_name = getattr(args, "v_dtype", None)
    v_dtype = None if v_name is None else _dtype(v_name)
    size = _size(args)
    decoder = Decoder(size, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    lens = np.linspace(max(1, args.prompt_len // 2), args.prompt_len, args.batch).round().astype(int)
    prompts = [rng.integers(0, decoder.vocab_size, n) for n in lens]
    # The ring takes chunks of up to 16 tokens (or the window): prefill wraps
    # around it whenever a prompt is longer than the ring.
    chunk = min(16, window)
    ring = dict(cache="circular", window=window, slots=window + chunk - 1)
    runs = [
        ("(a) no cache (recompute prefix)", dict(cache=None), None),
        ("(b) DynamicKVCache", dict(cache="dynamic"), "a"),
        ("(c) StaticKVCache float32", dict(cache="static"), "a"),
        (f"(d) StaticKVCache {kv_dtype}" + ("" if v_dtype is None else f" K, {v_dtype} V"),
         dict(cache="static", dtype=kv_dtype, v_dtype=v_dtype), "drift vs c"),
        (f"(a') no cache, window {window}", dict(cache=None, window=window), None),
        (f"(e) circular StaticKVCache, window {window}", ring, "a'"),
    ]
    cfg = decoder.config
    why = ""
    if args.size is None and size != DEFAULT_SIZE:
        option, name = _quantized_option(args)
        why = (f"; {size}: {option} {name} quantises blocks of {BLOCK} along the head, "
               f"{DEFAULT_SIZE}'s head size is {_head_dim(DEFAULT_SIZE)}")
    print(f"numkv demo: decoder {size!r} (embed {cfg['embed_dim']}, {cfg['num_layers']} layers, "
          f"{cfg['num_heads']} query / {cfg['num_kv_heads']} kv heads of {_head_dim(size)}, "
          f"vocab {cfg['vocab_size']}{why}), {numkv.get_num_threads()} threads")
    print(f"batch {args.batch}, prompts of {lens.min()}..{lens.max()} tokens, "
          f"{args.new_tokens} new tokens each, greedy")

    # Compile every kernel variant first, so that the timings below measure
    # decoding, not numba's compiler: the whole prompts (their prefill takes
    # the tile products where prompts of 2 tokens took the loops, and those
    # compiled inside the timed runs) and 2 new tokens.  From a cold disk
    # cache each run's first compile is announced before it starts.
    start = time.perf_counter()
    compiled = 0
    for label, kwargs, _ in runs:
        what, seconds = _first_compile(label)
        with compile_notice(what, seconds) as watch:
            decoder.generate(prompts, 2, **kwargs)
        compiled += watch.compiled
    note = " (numba keeps the kernels in its disk cache: later runs skip this)" if compiled else ""
    print(f"compile + warm-up: {time.perf_counter() - start:.1f} s{note}", flush=True)

    total = args.batch * args.new_tokens
    print(f"\n{'run':<44}{'time':>9}{'tokens/s':>11}{'speed-up':>10}  check", flush=True)
    refs, ok = {}, True
    for label, kwargs, against in runs:
        tokens, logits, elapsed = _timed(decoder, prompts, args.new_tokens, label, **kwargs)
        refs[label[1:label.index(")")]] = (tokens, logits, elapsed)
        if against is None:  # a reference run
            note = "reference" if label.startswith("(a)") else "reference for (e)"
        elif against == "drift vs c":  # a lossy cache against the float32 one
            note = "drift vs (c): " + _drift(tokens, logits, *refs["c"][:2])
        else:
            good, what, worst, _ = _compare(tokens, logits, *refs[against][:2])
            ok &= good
            note = f"{'OK' if good else 'MISMATCH'} vs ({against}): {what}, max |dlogit| {worst:.2e}"
        speedup = refs["a"][2] / elapsed
        print(f"{label:<44}{elapsed:>8.3f}s{total / elapsed:>11.1f}{speedup:>9.1f}x  {note}", flush=True)
    if not ok:
        print("demo: the cached runs do not agree with recomputation", file=sys.stderr)
        raise SystemExit(1)
    print("\nall cached runs agree with recomputation")
