"""``python -m numkv bench``: the command, its options and the run of the cases.

The cases live in ``bench_cases``, the timing and the report in ``timing``,
the machine's limits in ``bench_limits``; ``--plot`` hands over to ``plot``.
"""

from numkv._cli import bench_cases, timing
from numkv._cli.options import MAX_WORKERS, count, image_path, regex


def add_parser(subparsers):
    parser = subparsers.add_parser(
        "bench", help="numkv's speed beside its peers and the machine's limits",
        description="numkv's speed beside onnxruntime, torch, onnx.reference and NumPy (those installed): "
                    "medians of samples taken in turn, ratios to numkv, and each line's share of the "
                    "machine's GEMM rate (prefill) or read bandwidth (decode), measured at the start.",
    )
    parser.add_argument("--quick", action="store_true",
                        help="fewer samples per case (at least 3): rough figures, a shorter run")
    parser.add_argument("--threads", type=count(1, MAX_WORKERS), default=None, metavar="N",
                        help="threads for numkv, BLAS, onnxruntime and torch (default: their own, "
                             "usually one per core)")
    parser.add_argument("--only", type=regex, default=None, metavar="REGEX",
                        help="run only the cases whose id or title matches REGEX (see --list)")
    parser.add_argument("--list", action="store_true", help="list the cases (id and title) and exit")
    parser.add_argument("--plot", type=image_path, default=None, metavar="FILE.png",
                        help="instead of the cases, time decode and prefill over a range of lengths and "
                             "draw them, numkv beside every installed peer (needs matplotlib: numkv[plot])")
    parser.set_defaults(run=run, check=check, parser=parser)
    return parser


def check(args):
    """What is wrong with the options together (None: nothing)."""
    if args.plot and (args.only is not None or args.list):
        return "--plot runs its own sweep: --only and --list don't apply to it"
    return None


def run(args):
    if args.plot:
        from numkv._cli import plot

        return plot.run(args)
    settings = timing.Settings.from_args(args)
    every_case = bench_cases.default_cases(args.threads)
    cases = bench_cases.select(every_case, args.only)
    if args.list:
        print(case_list(cases))
        return 0
    if not cases:
        raise SystemExit(f"no case matches --only {args.only!r}; the cases are:\n{case_list(every_case)}")
    with timing._set_threads(args.threads):
        timing.print_header(args.threads)
        limits = timing.measure_and_print_limits()
        print(f"  median time per call, samples taken in turn (at least {settings.min_samples} per attention "
              f"implementation); ratio = time / numkv's; % = of the GEMM rate (prefill) or read "
              f"bandwidth (decode)")
        timing.warm_up_kernels()
        results = []
        for number, case in enumerate(cases, 1):
            print(f"\n[{number}/{len(cases)}] {case.id}: {case.title}", flush=True)
            results.append(timing.time_case(case, settings))
            timing.print_case(results[-1], limits)
        timing.print_summary(results, limits)
    return 0


def case_list(cases):
    return "\n".join(f"{case.id:<44} {case.title}" for case in cases)
