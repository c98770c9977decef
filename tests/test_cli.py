"""The command line's conventions: ``--version``, ``--help`` on every command,
``info``, the ``numkv`` script, and the first-compile notice; every bad option
value is a one-line usage error (exit status 2) when it parses, before any
work, never a traceback (issue 32.5; in process, so that each bad value costs
milliseconds).  (``demo`` is tested in test_layers.py, ``bench`` in
test_cli_bench.py, ``warmup`` in test_cli_warmup.py.)"""

import contextlib
import io
import os
import re
import shutil
import string
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, strategies as st

import numkv
from numkv.__main__ import build_parser, main
from numkv._cli.options import IMAGE_SUFFIXES, MAX_WORKERS

ROOT = Path(__file__).resolve().parents[1]


def _commands():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return sorted(sub.choices)


def test_the_commands_the_api_promises_exist():
    assert {"info", "demo", "bench", "warmup"} <= set(_commands())


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"numkv {numkv.__version__}"


@pytest.mark.parametrize("command", _commands())
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and command in out.splitlines()[0]
    assert len(out.splitlines()) > 3  # a description and the options, not just a usage line


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in _commands():
        assert re.search(rf"^\s+{command}\s", out, re.M), command


def test_the_script_calls_itself_numkv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/numkv"])
    assert build_parser().prog == "numkv"
    monkeypatch.setattr(sys, "argv", ["/x/numkv/__main__.py"])
    assert build_parser().prog == "python -m numkv"


def test_the_console_script_is_declared():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"numkv": "numkv.__main__:main"}


@pytest.mark.skipif(shutil.which("numkv") is None, reason="the numkv script is not installed here")
def test_the_installed_script_answers_version():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(["numkv", "--version"], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip().startswith("numkv ")


def test_info_says_what_numkv_runs_on(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"numkv {numkv.__version__}" in out
    for field in ("numpy ", "numba ", "NumPy's BLAS: ", "prefill products: register blocks of 6 x ",
                  "threading: ", "launch: ", " us on ", "kernel cache: "):
        assert field in out, field
    assert f"threads: {numkv.get_num_threads()}, " in out


def test_no_command_means_info(capsys):
    assert main([]) == 0
    assert "kernel cache: " in capsys.readouterr().out


def test_info_reports_the_cache_directory_numba_uses(capsys):
    from numkv._cli.info import cache_location

    path, note = cache_location()
    assert path is not None and os.path.isdir(path), note
    wanted = os.environ.get("NUMBA_CACHE_DIR")
    if wanted:
        assert Path(path).resolve().is_relative_to(Path(wanted).resolve())
    assert "writable" in note


def test_info_with_the_disk_cache_off():
    env = dict(os.environ, NUMKV_CACHE="0", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "numkv", "info"], capture_output=True, text=True,
                         env=env, check=True, cwd=ROOT).stdout
    assert "kernel cache: -  (off (NUMKV_CACHE=0)" in out


def test_info_says_numba_ignores_a_cache_directory_it_cannot_write(tmp_path):
    """numba passes over a NUMBA_CACHE_DIR it can't write to without a word
    (here a file, which even root can't make a directory in)."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(blocked), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "numkv", "info"], capture_output=True, text=True,
                         env=env, check=True, cwd=ROOT).stdout
    assert f"NUMBA_CACHE_DIR={blocked} is not writable by this user, so numba ignores it" in out


# -- the first-compile notice -----------------------------------------------------

def _jitted(module):
    """A fresh numba function whose Python function lives in ``module``."""
    import numba

    namespace = {"__name__": module}
    exec("def kernel(x):\n    return x + 1\n", namespace)
    return numba.njit(namespace["kernel"])


def test_compile_notice_speaks_before_compiling_and_only_then():
    import io

    from numkv._cli.compile_notice import compile_notice

    kernel = _jitted("numkv._fake_kernels")
    stream = io.StringIO()
    with compile_notice("the fake family", seconds=3, stream=stream, hint=False) as watch:
        said_before = stream.getvalue()  # nothing compiled yet: nothing said
        kernel(1)
        said_during = stream.getvalue()
    assert said_before == ""
    assert said_during == "compiling numkv's kernels for the fake family (first run only, ~3 s) ... "
    assert re.fullmatch(r"compiling .* \.\.\. \d+\.\d s\n", stream.getvalue())
    assert watch.compiled == 1 and watch.kernels == ["kernel(int64)"]

    stream = io.StringIO()
    with compile_notice("the fake family", stream=stream) as watch:
        kernel(2)  # compiled already: silent
    assert stream.getvalue() == "" and watch.compiled == 0


def test_compile_notice_ignores_other_packages_kernels():
    import io

    from numkv._cli.compile_notice import compile_notice

    stream = io.StringIO()
    with compile_notice("x", stream=stream) as watch:
        _jitted("somebody_else")(1)
    assert stream.getvalue() == "" and watch.compiled == 0


def test_compile_notice_ends_its_line_when_the_call_fails():
    import io

    from numkv._cli.compile_notice import compile_notice

    stream = io.StringIO()
    kernel = _jitted("numkv._fake_kernels")
    with pytest.raises(RuntimeError):
        with compile_notice("x", stream=stream, hint=False):
            kernel(1)
            raise RuntimeError("boom")
    assert stream.getvalue().endswith(" s\n")


# -- bad option values are usage errors, before any work (issue 32.5) --


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


# --- issue 32.5's reproducers ----------------------------------------------------------


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
    ("demo", "--kv-dtype"): not_one_of(("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "q8_0", "q4_0", "q4_1")),
    ("demo", "--v-dtype"): not_one_of(("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "q8_0", "q4_0", "q4_1")),
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


# --- the demo's timings ------------------------------------------------------------------


def test_the_demo_compiles_nothing_inside_its_timed_runs(monkeypatch, capsys):
    """The demo's warm-up fetches every C function its timed runs call --
    prompts of 8-16 tokens prefill through the tile products, and a float16
    cache's keys are widened into them -- so that from an empty numba cache
    tokens/s and speed-ups measure decoding, not numba's compiler.  (Its
    warm-up on prompts of 2 tokens took the loops, and the timed runs
    compiled the products.)  Run with the loop tables and kept plans
    emptied, so that every C function a call needs is fetched again
    (``loop_functions._compile``, from the disk cache): none may be in a timed
    run."""
    from numkv import _attention
    from numkv._cli import demo
    from numkv._kernels import loop_functions

    monkeypatch.setattr(loop_functions, "TABLES", np.zeros_like(loop_functions.TABLES))
    monkeypatch.setattr(loop_functions, "_tables", {})
    monkeypatch.setattr(loop_functions, "_compiled", {})
    monkeypatch.setattr(_attention, "_plans", {})
    phase, fetched = ["warm-up"], []
    compile_, timed = loop_functions._compile, demo._timed

    def fetch(acc, code, field):
        fetched.append((phase[0], code, loop_functions.LOOP_FIELDS[field]))
        return compile_(acc, code, field)

    def timed_run(*args, **kwargs):
        phase[0] = "timed"
        return timed(*args, **kwargs)

    monkeypatch.setattr(loop_functions, "_compile", fetch)
    monkeypatch.setattr(demo, "_timed", timed_run)
    assert main(["demo", "--size", "tiny", "--batch", "2", "--prompt-len", "16", "--new-tokens", "2",
                 "--kv-dtype", "float16", "--threads", "1"]) == 0
    capsys.readouterr()
    assert ("warm-up", loop_functions.F32, "gemm_scores") in fetched, fetched  # the tile products were fetched
    assert [f for f in fetched if f[0] == "timed"] == []


# --- the demo's quantised caches (issue 28) ----------------------------------------------


def test_demo_with_a_q8_0_cache_reports_agreement_and_drift(capsys):
    """``--kv-dtype q8_0``: run (d) over a q8_0 StaticKVCache, its tokens and
    logits against (c), the float32 cache; the default size is then 'base'
    (the presets' smallest head size of whole blocks of 32), and says so."""
    assert main(["demo", "--kv-dtype", "q8_0", "--batch", "2", "--prompt-len", "6", "--new-tokens", "3",
                 "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("numkv demo: decoder 'base' (") and "kv heads of 32" in out
    assert "--kv-dtype q8_0 quantises blocks of 32 along the head, small's head size is 16" in out
    (line,) = [line for line in out.splitlines() if line.startswith("(d) StaticKVCache q8_0")]
    assert re.search(r"drift vs \(c\): 6/6 tokens equal \(100\.0%\), max \|dlogit\| \d\.\d\de[-+]\d\d = "
                     r"\d+\.\d\d% of max \|logit\| \S+ \(before divergence\)", line), line
    assert re.search(r"\d+\.\d+s\s+\d+\.\d+\s+\d+\.\dx", line), line  # time, tokens/s, speed-up
    assert "all cached runs agree" in out and "MISMATCH" not in out


def test_demo_with_a_q4_0_cache_at_an_explicit_size(capsys):
    assert main(["demo", "--kv-dtype", "q4_0", "--size", "base", "--batch", "2", "--prompt-len", "5",
                 "--new-tokens", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("numkv demo: decoder 'base' (") and "small's head size" not in out
    (line,) = [line for line in out.splitlines() if line.startswith("(d) StaticKVCache q4_0")]
    assert re.search(r"drift vs \(c\): \d/4 tokens equal \(\d+\.\d%\), max \|dlogit\| \S+ = \S+% of max", line), line


def test_demo_with_q8_0_keys_and_q4_0_values(capsys):
    """``--kv-dtype q8_0 --v-dtype q4_0``: run (d) over a cache of q8_0 keys
    and q4_0 values, labelled so, its drift reported (llama.cpp's -ctk / -ctv)."""
    assert main(["demo", "--kv-dtype", "q8_0", "--v-dtype", "q4_0", "--batch", "2", "--prompt-len", "5",
                 "--new-tokens", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("numkv demo: decoder 'base' (")
    (line,) = [line for line in out.splitlines() if line.startswith("(d) StaticKVCache q8_0 K, q4_0 V")]
    assert re.search(r"drift vs \(c\): \d/4 tokens equal \(\d+\.\d%\), max \|dlogit\| \S+ = \S+% of max", line), line
    assert "all cached runs agree" in out


@pytest.mark.parametrize("size", ["tiny", "small"])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_demo_quantised_cache_at_a_size_it_cannot_take(size, fmt):
    """A preset whose head size 32 does not divide: a usage error naming
    both options and the size that works, before any work."""
    assert_usage_error(["demo", "--kv-dtype", fmt, "--size", size], call=main,
                       says=f"--kv-dtype {fmt} quantises blocks of 32 along the head, but --size {size} has "
                            f"head size 16: use --size base (head size 32), or leave --size out")


def test_demo_default_size_is_unchanged_for_float_caches():
    from numkv._cli.demo import _size

    for kv, size in (("bfloat16", "small"), ("float8_e5m2", "small"), ("q8_0", "base"), ("q4_0", "base")):
        assert _size(build_parser().parse_args(["demo", "--kv-dtype", kv])) == size
    assert _size(build_parser().parse_args(["demo", "--v-dtype", "q4_1"])) == "base"
    assert_usage_error(["demo", "--v-dtype", "q4_1", "--size", "small"], call=main,
                       says="--v-dtype q4_1 quantises blocks of 32 along the head, but --size small")
    assert _size(build_parser().parse_args(["demo", "--size", "tiny"])) == "tiny"
