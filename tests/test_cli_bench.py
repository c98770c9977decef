"""``python -m numkv bench``'s timing and report (the figures in the README)."""

from numkv import _cli_bench


def test_measure_takes_the_samples_in_turn():
    calls = []
    fns = [lambda: calls.append("a"), lambda: calls.append("b")]
    times = _cli_bench.measure(fns, repeats=4, min_sample=0.0, budget=10.0)
    assert len(times) == 2 and all(t > 0 for t in times)
    timed = calls[4:]  # after each fn's warm-up call and its one-call sizing sample
    assert timed == ["a", "b"] * 4


def test_measure_gives_a_slow_fn_fewer_samples_but_three():
    calls = {"fast": 0, "slow": 0}

    def slow():
        calls["slow"] += 1
        _spin(0.004)

    fns = [lambda: calls.__setitem__("fast", calls["fast"] + 1), slow]
    _cli_bench.measure(fns, repeats=20, min_sample=0.0, budget=0.01)
    assert calls["slow"] == 2 + 3  # warm-up, sizing, three samples
    assert calls["fast"] > calls["slow"]


def test_report_says_which_peer_failed_and_times_the_rest(capsys):
    def broken():
        raise RuntimeError("not supported here")

    impls = [("numkv", lambda: 1.0), ("peer that fails", broken), ("peer", lambda: 1.0)]
    _cli_bench._report("case", impls, repeats=3, budget=0.1, check=True)
    out = capsys.readouterr().out
    assert "peer that fails" in out and "failed: RuntimeError: not supported here" in out
    assert "1.00x" in out and "max|dY| 0.0e+00" in out


def _spin(seconds):
    import time

    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
