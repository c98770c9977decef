"""``python -m numkv bench --plot FILE.png``: decode and prefill time against length.

Two panels, log-log, numkv beside every installed peer: a decode step (B=1,
Hq=32, Hkv=8, D=128, one query, float32 K/V) against the number of cached keys
(1k to 16k), and a causal prefill (the same heads, float32) against the
sequence length (512 to 4096).  Each point is timed as a case of
``python -m numkv bench`` is (``timing.time_case``: medians of samples taken
in turn, the first call untimed), on the same workloads (``bench_cases``).
A dashed line marks the time at 100 % of the machine limit measured at the start
of the run (read bandwidth for decode, the fp32 GEMM rate for prefill).
onnx.reference and NumPy drop out where they would materialise a large score
matrix (``bench_cases.REFERENCE_MAX_SCORES`` / ``NUMPY_MAX_SCORES``).

matplotlib is optional (the ``plot`` extra) and imported only here.
"""

import os
from typing import Callable, NamedTuple

from numkv._cli import bench_cases, timing

DECODE_LENGTHS = (1024, 2048, 4096, 8192, 16384)
PREFILL_LENGTHS = (512, 1024, 2048, 4096)



class Panel(NamedTuple):
    title: str
    x_label: str
    workload: Callable  # length -> bench_cases.Workload
    lengths: tuple


PANELS = (
    Panel("decode: B=1 Hq=32 Hkv=8 D=128, one query, float32", "cached keys (Skv)",
          bench_cases.decode, DECODE_LENGTHS),
    Panel("causal prefill: B=1 Hq=32 Hkv=8 D=128, float32", "sequence length (Sq = Skv)",
          bench_cases.causal_prefill, PREFILL_LENGTHS),
)


def _figure_class():
    """matplotlib's ``Figure`` (no pyplot, no GUI backend), or a clear exit."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise SystemExit("--plot needs matplotlib, which is not installed: "
                         "pip install 'numkv[plot]' (or pip install matplotlib)") from None
    return Figure


def sweep_points(panels):
    """``[(panel, length, workload)]`` in the order they run."""
    return [(panel, n, panel.workload(n)) for panel in panels for n in panel.lengths]


def sweep(points, settings, threads=None):
    """Time every point; returns ``{panel title: {label: [(length, seconds, work)]}}``.
    Prints one progress line per point."""
    series = {panel.title: {} for panel, _, _ in points}
    for number, (panel, n, workload) in enumerate(points, 1):
        print(f"[plot {number}/{len(points)}] {workload.id}: ", end="", flush=True)
        result = timing.time_case(bench_cases.attention_case(workload, threads),
                                      settings)
        timed = [t for t in result.timings if t.seconds is not None]
        for t in timed:
            series[panel.title].setdefault(t.impl.label, []).append((n, t.seconds, t.impl.work))
        print(", ".join(f"{t.impl.peer} {timing.fmt_time(t.seconds).strip()}" for t in timed), flush=True)
    return series


def _limit_line(points, panel, limits):
    """(lengths, seconds at 100 % of the panel's machine limit) for numkv's work."""
    xs, ys = [], []
    for p, n, workload in points:
        if p is panel:
            xs.append(n)
            ys.append(workload.work(workload.q_dtype, workload.kv_dtype) / limits.per_second(workload.limit))
    return xs, ys


def _limit_label(workload, limits):
    if workload.limit == "gemm":
        return f"100 % of fp32 GEMM ({limits.gemm_flops / 1e9:.0f} GFLOP/s)"
    return f"100 % of read bandwidth ({limits.read_bytes / 1e9:.1f} GB/s)"


def _seconds_label(seconds, _pos=None):
    """A log axis tick: "20 ms", "1.5 s"."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if seconds >= scale or unit == "ns":
            return f"{seconds / scale:g} {unit}"


def _length_label(n, _pos=None):
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else f"{n:g}"


def draw(path, points, series, limits, title, note):
    """Write the two-panel PNG to ``path``."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    figure = _figure_class()(figsize=(13, 5.8), layout="constrained")
    panels = list(dict.fromkeys(panel for panel, _, _ in points))
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels):
        for label, rows in series[panel.title].items():
            xs, ys = [r[0] for r in rows], [r[1] for r in rows]
            is_numkv = label.startswith("numkv")
            ax.plot(xs, ys, marker="o", linewidth=2.6 if is_numkv else 1.4, label=label,
                    color="black" if is_numkv else None, zorder=3 if is_numkv else 2)
        if limits is not None:
            workload = next(w for p, _, w in points if p is panel)
            xs, ys = _limit_line(points, panel, limits)
            ax.plot(xs, ys, linestyle="--", color="grey", label=_limit_label(workload, limits))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(list(panel.lengths)))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(_length_label))
        ax.yaxis.set_major_formatter(FuncFormatter(_seconds_label))
        ax.set_title(panel.title)
        ax.set_xlabel(panel.x_label)
        ax.set_ylabel("time per call (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    figure.suptitle(title)
    figure.text(0.5, -0.01, note, ha="center", va="top", fontsize="small", wrap=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")


def title_text(threads):
    import numkv

    thread_count = threads or timing.runtime_info()[1]
    return (f"numkv {numkv.__version__} beside its peers on {timing.machine_name()} "
            f"({os.cpu_count()} CPUs), {thread_count} threads\n{timing.versions()}")


def note_text(settings):
    return (f"Median time per call, at least {settings.min_samples} samples each, implementations sampled in turn. "
            f"onnx.reference and NumPy are left out where they would materialise a score matrix above "
            f"{bench_cases.REFERENCE_MAX_SCORES * 4 >> 20} / {bench_cases.NUMPY_MAX_SCORES * 4 >> 20} MiB.")


def run(args):
    """The ``--plot`` run: header, machine limits, the sweep, the PNG."""
    _figure_class()  # fail before minutes of timing, not after
    settings = timing.Settings(3, 2.0, 3) if args.quick else timing.Settings(5, 5.0, 3)
    with timing._set_threads(args.threads):
        timing.print_header(args.threads)
        limits = timing.measure_and_print_limits()
        points = sweep_points(PANELS)
        print(f"  {len(points)} points to time for {args.plot}")
        timing.warm_up_kernels()
        series = sweep(points, settings, args.threads)
        draw(args.plot, points, series, limits, title_text(args.threads), note_text(settings))
    print(f"wrote {args.plot}")
    return 0
