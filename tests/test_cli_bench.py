"""``python -m numkv bench``: timing, work formulas, peers, report, options and the
plot, on tiny shapes and monkeypatched case lists (the real bench takes minutes)."""

import sys

import numpy as np
import pytest

import numkv
from numkv._cli import bench_cases, bench_limits
from numkv._cli import timing as bench_timing
from numkv.__main__ import main


@pytest.fixture(autouse=True)
def no_settling(monkeypatch):
    """The real bench pauses between implementations (peers' threads spin
    down) and takes long samples; the tiny cases here need neither."""
    monkeypatch.setattr(bench_timing, "SETTLE", 0.0)
    monkeypatch.setattr(bench_timing, "MIN_SAMPLE", 0.02)
from numkv._cli.bench_cases import Case, Impl, Workload

TINY_LIMITS = bench_limits.MachineLimits(gemm_flops=1e10, read_bytes=1e10, gemm_n=64, read_nbytes=1 << 20)


def tiny_prefill(dtype="float32"):
    return Workload("causal prefill", 1, 4, 2, 16, 16, 8, True, dtype, dtype)


def tiny_decode(kv_dtype="float32", nonpad=None):
    kind = "decode" if nonpad is None else "external-cache decode"
    return Workload(kind, 2, 4, 2, 1, 32, 8, nonpad is not None, "float32", kv_dtype, nonpad)


# -- timing --------------------------------------------------------------------------

def test_measure_takes_the_samples_in_turn():
    calls = []
    fns = [lambda: calls.append("a"), lambda: calls.append("b")]
    times = bench_timing.measure(fns, repeats=4, min_sample=0.0, budget=10.0)
    assert len(times) == 2 and all(t > 0 for t in times)
    timed = calls[4:]  # after each fn's warm-up call and its one-call sizing sample
    assert timed == ["a", "b"] * 4


def test_measure_gives_a_slow_fn_fewer_samples_but_the_minimum():
    calls = {"fast": 0, "slow": 0}

    def slow():
        calls["slow"] += 1
        _spin(0.004)

    fns = [lambda: calls.__setitem__("fast", calls["fast"] + 1), slow]
    bench_timing.measure(fns, repeats=20, min_sample=0.0, budget=0.01)
    assert calls["slow"] == 2 + 3  # warm-up, sizing, three samples
    assert calls["fast"] > calls["slow"]
    calls["slow"] = 0
    bench_timing.measure([slow], repeats=20, min_sample=0.0, budget=0.01, min_samples=5, warm_up=False)
    assert calls["slow"] == 1 + 5  # sizing, five samples; no warm-up when the caller made it


# -- the work formulas -----------------------------------------------------------------

def test_causal_prefill_attends_a_triangle_and_flops_count_both_products():
    w = Workload("causal prefill", 1, 2, 1, 4, 4, 3, True)
    assert w.attended().tolist() == [[1, 2, 3, 4]]
    assert w.flops() == 2 * (1 + 2 + 3 + 4) * 2 * (3 + 3)  # heads x pairs x 2 x (D + Dv)
    assert Workload("full prefill", 1, 2, 1, 4, 4, 3).flops() == 2 * 16 * 2 * 6


def test_causal_with_an_external_cache_is_bottom_right_per_row():
    w = Workload("x", 2, 2, 1, 2, 6, 3, True, nonpad=(5, 1))
    assert w.attended().tolist() == [[4, 5], [0, 1]]  # offset = nonpad[b] - Sq


def test_decode_bytes_are_the_attended_kv_rows_plus_q_and_y():
    w = tiny_decode(nonpad=(10, 32))
    kv = 2 * (10 + 32) * (8 + 8) * 4  # Hkv x keys x (D + Dv) x float32
    q_and_y = 2 * (2 * 4 * 1 * 8 * 4)
    assert w.work("float32", "float32") == kv + q_and_y
    assert w.work("float32", "bfloat16") == kv // 2 + q_and_y  # the implementation's item sizes
    assert w.limit == "read" and tiny_prefill().limit == "gemm"


def test_percent_of_limit_divides_the_rate_by_the_limit():
    timing = bench_timing.Timing(Impl("x", "numkv", work=2e9), seconds=0.5)
    assert bench_timing.percent_of_limit(timing, "gemm", TINY_LIMITS) == pytest.approx(40.0)
    assert bench_timing.percent_of_limit(timing, None, TINY_LIMITS) is None


def test_machine_limits_are_positive_rates():
    limits = bench_limits.measure_limits(gemm_n=64, read_nbytes=1 << 20, repeats=1)
    assert limits.gemm_flops > 0 and limits.read_bytes > 0
    assert "GFLOP/s" in limits.describe() and "GB/s" in limits.describe()


# -- the implementations agree -----------------------------------------------------------

@pytest.mark.parametrize("workload", [tiny_prefill(), tiny_decode(), tiny_decode(nonpad=(9, 32)),
                                      Workload("full prefill", 1, 4, 2, 8, 8, 8)],
                         ids=lambda w: w.id)
def test_every_float32_implementation_computes_numkvs_y(workload):
    result = bench_timing.time_case(bench_cases.attention_case(workload), bench_timing.Settings(1, 0.01, 1))
    ran = [t for t in result.timings if t.seconds is not None]
    assert ran[0].impl.peer == "numkv" and {"numpy"} <= {t.impl.peer for t in ran}
    for timing in ran[1:]:
        assert timing.max_dy < 1e-5, timing.impl.label


def test_threads_option_sets_every_blas_and_restores_it(monkeypatch):
    from threadpoolctl import threadpool_info

    def blas_counts():
        return {lib["filepath"]: lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}

    monkeypatch.setattr(bench_timing, "_have", lambda module: False)  # leave torch's count alone
    before = blas_counts()
    with bench_timing._set_threads(3):
        during = blas_counts()
        assert numkv.get_num_threads() == 3
    numkv.set_num_threads(None)
    assert all(n == 3 for n in during.values())  # (none where threadpoolctl sees no BLAS)
    assert blas_counts() == before


@pytest.mark.parametrize("workload", [tiny_prefill("bfloat16"), tiny_decode("float8_e4m3fn")], ids=lambda w: w.id)
def test_narrow_workloads_get_float32_and_narrow_peers(workload):
    impls = bench_cases.attention_impls(workload)
    labels = [i.label for i in impls]
    assert "numkv" in labels[0] and workload.narrow_dtype in labels[0]
    assert not any(i.peer == "onnx.reference" for i in impls)  # float32 workloads only
    if bench_cases.have("torch"):
        assert any("torch" in label and "(bfloat16)" in label for label in labels)


@pytest.mark.parametrize("workload", [tiny_decode(), tiny_decode(nonpad=(9, 32)), tiny_decode("bfloat16"),
                                      Workload("decode", 2, 6, 2, 1, 20, 8, False, "float32", "float8_e4m3fn")],
                         ids=lambda w: w.id)
def test_torch_packed_gqa_peer_computes_numkvs_y(workload):
    """Decode with GQA gets torch's packed peer (each kv head's query heads on
    the query axis, one call), beside the ``enable_gqa`` one, in float32 and
    the narrow stand-in; with an external cache as a mask and per row; its Y
    is numkv's (Hkv = 2, G >= 2: a wrong head map would show)."""
    pytest.importorskip("torch")
    result = bench_timing.time_case(bench_cases.attention_case(workload, peers=("numkv", "torch")),
                                    bench_timing.Settings(1, 0.01, 1))
    packed = [t for t in result.timings if "GQA packed" in t.impl.label]
    dtypes = ["float32"] if workload.narrow_dtype is None else ["float32", "bfloat16"]
    forms = 1 if workload.nonpad is None else 2  # bool mask and K/V sliced per row
    assert len(packed) == len(dtypes) * forms, [t.impl.label for t in result.timings]
    for timing in packed:
        assert timing.seconds is not None, timing.impl.note
        tolerance = 1e-5 if "(float32)" in timing.impl.label else 2e-2
        assert timing.max_dy < tolerance, timing.impl.label


def test_torch_packed_queries_follow_the_onnx_head_map():
    """Query head ``h`` is kv head ``h // G``'s row block ``h % G``, and
    ``_unpacked_heads`` inverts ``_packed_queries``."""
    torch = pytest.importorskip("torch")
    b, hq, hkv, sq, d = 2, 6, 2, 3, 4
    q = torch.arange(b * hq * sq * d, dtype=torch.float32).reshape(b, hq, sq, d)
    packed = bench_cases._packed_queries(q, hkv)
    assert packed.shape == (b, hkv, (hq // hkv) * sq, d)
    for h in range(hq):
        kv, g = divmod(h, hq // hkv)
        assert torch.equal(packed[:, kv, g * sq:(g + 1) * sq], q[:, h])
    assert torch.equal(bench_cases._unpacked_heads(packed, hq, sq), q)


def test_no_packed_peer_without_gqa_or_beyond_decode():
    pytest.importorskip("torch")
    for workload in (tiny_prefill(), Workload("decode", 1, 2, 2, 1, 16, 8)):
        assert not any("GQA packed" in i.label for i in bench_cases.attention_impls(workload, peers=("torch",)))


def test_the_default_cases_hold_llama_3_2_1b_decode():
    ids = [case.id for case in bench_cases.default_cases()]
    assert "decode-Hq32-Hkv8-D64-Skv2048-float32" in ids and "decode-Hq16-Hkv4-D64-Skv1088-float32" in ids


def test_numpy_peer_skips_a_large_score_matrix_and_says_so():
    big = Workload("causal prefill", 1, 32, 8, 2048, 2048, 128, True)
    impl = bench_cases._numpy_impl(big, wide=None)
    assert impl.fn is None and "skipped" in impl.note and "512 MiB" in impl.note


def test_keep_mask_matches_attended():
    w = Workload("x", 2, 2, 1, 3, 6, 3, True, nonpad=(5, 2))
    assert (bench_cases.keep_mask(w).sum(axis=-1)[:, 0] == w.attended()).all()


def test_causal_without_an_external_cache_attends_from_the_top_left():
    """Sq < Skv, is_causal, no nonpad_kv_seqlen: numkv's offset is 0 (API.md),
    and the bench's mask and work formulas follow it (they assumed Skv - Sq)."""
    w = Workload("causal prefill", 1, 4, 2, 3, 8, 16, True)
    assert w.attended().tolist() == [[1, 2, 3]]
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, 3, 16), np.float32)
    k = rng.standard_normal((1, 2, 8, 16), np.float32)
    np.testing.assert_array_equal(numkv.attention(q, k, k, is_causal=True),
                                  numkv.attention(q, k, k, attn_mask=bench_cases.keep_mask(w)))


# -- the report ------------------------------------------------------------------------

def _case(name="case", peers=2, fail=True, work=1e6, limit="gemm"):
    def build():
        impls = [Impl("numkv thing", "numkv", lambda: np.ones(3), work)]
        if fail:
            impls.append(Impl("peer that fails", "other", _broken, work))
            impls.append(Impl("peer not built", "other", None, work, note="skipped: too big"))
        impls += [Impl(f"peer {i}", "other", lambda: np.ones(3), work) for i in range(peers - 1)]
        return impls
    return Case(name, f"title of {name}", build, limit=limit, min_samples=1)


def _broken():
    raise RuntimeError("not supported here")


def test_report_says_which_peer_failed_and_times_the_rest(capsys):
    result = bench_timing.time_case(_case(), bench_timing.Settings(3, 0.1, 1))
    bench_timing.print_case(result, TINY_LIMITS)
    out = capsys.readouterr().out
    assert "peer that fails" in out and "failed: RuntimeError: not supported here" in out
    assert "peer not built" in out and "skipped: too big" in out
    assert "1.00x" in out and "max|dY| 0.0e+00" in out and "% GEMM" in out and "GFLOP/s" in out


def test_summary_names_the_best_peer_and_the_ratio(capsys):
    results = [bench_timing.time_case(_case("first"), bench_timing.Settings(3, 0.1, 1)),
               bench_timing.time_case(_case("alone", peers=1, fail=False, limit=None), bench_timing.Settings(3, 0.1, 1))]
    bench_timing.print_summary(results, TINY_LIMITS)
    lines = capsys.readouterr().out.splitlines()
    first = next(line for line in lines if line.strip().startswith("first"))
    assert "peer 0" in first and first.rstrip().endswith("x") and "%" in first
    assert "(no peer ran)" in next(line for line in lines if line.strip().startswith("alone"))


# -- the command line --------------------------------------------------------------------

@pytest.fixture
def tiny_bench(monkeypatch):
    """``bench`` on three tiny cases (numkv and NumPy only) with fixed limits;
    records when the compile hook runs relative to the first case."""
    events = []

    def cases(threads=None):
        made = [bench_cases.attention_case(w, threads, peers=("numkv", "numpy"))
                for w in (tiny_prefill(), tiny_decode(), tiny_decode(nonpad=(3, 32)))]
        for case in made:
            build = case.build
            case.build = lambda build=build: events.append("case") or build()
        return made

    monkeypatch.setattr(bench_cases, "default_cases", cases)
    monkeypatch.setattr(bench_limits, "measure_limits", lambda: TINY_LIMITS)
    monkeypatch.setattr(bench_timing, "warm_up_kernels", lambda: events.append("hook"))
    return events


def test_bench_numbers_the_cases_and_ends_with_a_summary(tiny_bench, capsys):
    main(["bench", "--quick"])
    out = capsys.readouterr().out
    assert "[1/3] causal-prefill" in out and "[2/3] decode" in out and "[3/3] external" in out
    assert "machine limits: fp32 GEMM 10.0 GFLOP/s" in out and "read bandwidth 10.0 GB/s" in out
    assert "% read" in out and "% GEMM" in out
    assert "summary" in out.split("[3/3]")[1]
    assert tiny_bench[:2] == ["hook", "case"] and tiny_bench.count("hook") == 1


def test_only_runs_the_matching_cases(tiny_bench, capsys):
    main(["bench", "--quick", "--only", "^external|nonpad"])
    out = capsys.readouterr().out
    assert "[1/1] external-cache-decode" in out and "causal-prefill" not in out


def test_only_without_a_match_lists_the_cases(tiny_bench):
    with pytest.raises(SystemExit, match="(?s)no case matches --only 'nothing'.*causal-prefill"):
        main(["bench", "--only", "nothing"])


def test_list_prints_ids_and_runs_nothing(tiny_bench, capsys):
    main(["bench", "--list"])
    out = capsys.readouterr().out
    assert out.count("\n") == 3 and "causal-prefill-Hq4-Hkv2-D8-S16-float32" in out
    assert tiny_bench == []


def test_the_default_cases_hold_the_issues_workloads():
    ids = [case.id for case in bench_cases.default_cases()]
    for expected in ("causal-prefill-S2048-bfloat16", "full-prefill-S1024-float32", "decode-Skv16384-float32",
                     "decode-Skv16384-kv-float8_e4m3fn", "decode-B8-Skv2048-float32",
                     "external-cache-decode-B4-Skv4096-float32", "decode-Hq16-Hkv4-D64-Skv1088-float32",
                     "scatter-in-place"):
        assert expected in ids
    assert len(set(ids)) == len(ids)


# -- --plot ------------------------------------------------------------------------------

@pytest.fixture
def tiny_plot(tiny_bench, monkeypatch):
    from numkv._cli import plot

    panels = (plot.Panel("decode", "keys", lambda n: Workload("decode", 1, 4, 2, 1, n, 8), (16, 32)),
              plot.Panel("prefill", "seq", lambda n: Workload("causal prefill", 1, 4, 2, n, n, 8, True), (8, 16)))
    monkeypatch.setattr(plot, "PANELS", panels)
    return plot


def test_plot_writes_a_png(tiny_plot, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    main(["bench", "--plot", str(path), "--quick"])
    out = capsys.readouterr().out
    assert "[plot 1/4]" in out and "[plot 4/4]" in out and f"wrote {path}" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_plot_without_matplotlib_says_how_to_get_it(tiny_plot, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(SystemExit, match=r"numkv\[plot\]"):
        main(["bench", "--plot", str(tmp_path / "x.png")])
    assert not (tmp_path / "x.png").exists()


def _spin(seconds):
    import time

    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass



def test_measure_pauses_before_each_sample_when_implementations_alternate(monkeypatch):
    pauses = []
    monkeypatch.setattr(bench_timing, "SETTLE", 0.125)
    monkeypatch.setattr(bench_timing.time, "sleep", pauses.append)
    bench_timing.measure([lambda: None, lambda: None], repeats=3, min_sample=1e-4)
    assert pauses == [0.125] * 6
    pauses.clear()
    bench_timing.measure([lambda: None], repeats=3, min_sample=1e-4)  # one implementation: nothing to settle
    assert pauses == []
