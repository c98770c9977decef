"""The command line answers every bad option value with a one-line usage
error (exit status 2) when it parses, before any work, never a traceback
(issue 32.5).  In process (``build_parser().parse_args`` / ``main``), so that
each bad value costs milliseconds."""

import contextlib
import io
import re
import string
import time

import pytest
from hypothesis import given, strategies as st

from numkv._cli import build_parser, main
from numkv._cli.options import IMAGE_SUFFIXES, MAX_WORKERS


def usage_error(argv, call=None):
    """Run ``argv`` through the parser (or ``call``): the exit status and
    what went to stderr, and the seconds it took."""
    err = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        with pytest.raises(SystemExit) as exc:
            (call or build_parser().parse_args)(argv)
    return exc.value.code, err.getvalue(), time.perf_counter() - start


def assert_usage_error(argv, call=None, says=None):
    code, err, seconds = usage_error(argv, call)
    assert code == 2, (argv, code, err)
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert re.match(r"\S.* error: ", last), err  # "python -m numkv demo: error: ..."
    assert seconds < 1.0
    if says is not None:
        assert says in last, last
    return last


# --- the issue's reproducers ------------------------------------------------------------


@pytest.mark.parametrize("argv, says", [
    (["demo", "--threads", "0"], "argument --threads: must be an integer in [1, 1024], got '0'"),
    (["demo", "--threads", "-1"], "argument --threads"),
    (["demo", "--seed", "-1"], "argument --seed: must be an integer >= 0"),
    (["bench", "--only", "("], "argument --only: '(' is not a regular expression"),
    (["warmup", "--jobs", "-1"], "argument --jobs/-j"),
    (["demo", "--window", "-1"], "argument --window: must be an integer >= 1"),
    (["demo", "--window", "0"], "argument --window: must be an integer >= 1"),
    (["bench", "--quick", "--plot", "/missing-folder/x.png"], "the folder /missing-folder does not exist"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_the_issues_bad_values_are_usage_errors(argv, says):
    assert_usage_error(argv, says=says)


def test_plot_into_a_folder_or_an_unknown_format(tmp_path):
    assert_usage_error(["bench", "--plot", str(tmp_path)], says="is a folder, not a file")
    assert_usage_error(["bench", "--plot", str(tmp_path / "x.gif")], says="cannot draw a .gif file")


def test_plot_with_only_or_list_is_a_usage_error_before_any_work(tmp_path):
    for extra in (["--only", "decode"], ["--list"]):
        assert_usage_error(["bench", "--plot", str(tmp_path / "x.png"), *extra], call=main,
                           says="--plot runs its own sweep")


def test_good_values_still_parse(tmp_path):
    args = build_parser().parse_args(["demo", "--threads", "1", "--window", "1", "--seed", "0"])
    assert (args.threads, args.window, args.seed) == (1, 1, 0)
    args = build_parser().parse_args(["bench", "--only", "^decode|prefill", "--plot", str(tmp_path / "a.svg")])
    assert args.only == "^decode|prefill" and args.plot.endswith("a.svg")
    assert build_parser().parse_args(["warmup", "-j", "2"]).jobs == 2


# --- every option of every subcommand, random bad values (hypothesis) -------------------


def not_an_integer():
    return st.text(alphabet=string.ascii_letters + string.digits + ".,-+e ", min_size=0, max_size=8).filter(
        lambda t: not re.fullmatch(r"\s*[-+]?\d+(_\d+)*\s*", t))


def below(minimum):
    return st.integers(max_value=minimum - 1, min_value=-10 ** 30).map(str)


def bad_count(minimum, maximum=None):
    strategies = [below(minimum), not_an_integer()]
    if maximum is not None:
        strategies.append(st.integers(min_value=maximum + 1, max_value=10 ** 30).map(str))
    return st.one_of(*strategies)


def not_a_regex():
    def compiles(text):
        try:
            re.compile(text)
            return True
        except re.error:
            return False

    return st.text(alphabet="()[]{}*+?\\|^$a1,", min_size=1, max_size=6).filter(lambda t: not compiles(t))


def bad_plot_path():
    name = st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=6)
    return st.one_of(
        name.map(lambda n: f"/nonexistent-{n}/{n}.png"),
        name.filter(lambda n: f".{n}" not in IMAGE_SUFFIXES).map(lambda n: f"plot.{n}"),
        st.just("/"),
    )


def not_one_of(choices):
    return st.text(min_size=1, max_size=8).filter(lambda t: t not in choices and "\x00" not in t)


OPTIONS = {
    ("demo", "--batch"): bad_count(1),
    ("demo", "--prompt-len"): bad_count(1),
    ("demo", "--new-tokens"): bad_count(1),
    ("demo", "--threads"): bad_count(1, MAX_WORKERS),
    ("demo", "--window"): bad_count(1),
    ("demo", "--seed"): bad_count(0),
    ("demo", "--size"): not_one_of(("tiny", "small", "base")),
    ("demo", "--kv-dtype"): not_one_of(("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")),
    ("bench", "--threads"): bad_count(1, MAX_WORKERS),
    ("bench", "--only"): not_a_regex(),
    ("bench", "--plot"): bad_plot_path(),
    ("warmup", "--jobs"): bad_count(1, MAX_WORKERS),
    ("warmup", "--group"): not_one_of(("scatter",)),
}


def test_every_option_with_a_value_is_covered():
    """A new option must join OPTIONS (and get a type that checks it)."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    found = {(name, action.option_strings[0]) for name, p in sub.choices.items() for action in p._actions
             if action.option_strings and action.nargs != 0}
    assert found == set(OPTIONS)


@pytest.mark.filterwarnings("ignore:Possible nested set:FutureWarning")
@pytest.mark.parametrize("option", OPTIONS, ids=" ".join)
@given(data=st.data())
def test_random_bad_values_are_usage_errors(option, data):
    command, flag = option
    value = data.draw(OPTIONS[option])
    if command == "warmup" and flag == "--group":
        from numkv._cli.warmup import GROUPS

        if value in GROUPS:
            return
    assert_usage_error([command, f"{flag}={value}"])
