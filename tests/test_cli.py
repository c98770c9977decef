"""The command line's conventions: ``--version``, ``--help`` on every command,
``info``, the ``numkv`` script, and the first-compile notice.  (``demo`` is
tested in test_layers.py, ``bench`` in test_cli_bench.py, ``warmup`` in
test_cli_warmup.py.)"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import numkv
from numkv.__main__ import build_parser, main

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
    for field in ("numpy ", "numba ", "BLAS of prefill's products: numkv's own, openblas ", "NumPy's BLAS: ",
                  "prefill products: ", "threading: ", "kernel cache: "):
        assert field in out, field
    assert f"threads: {numkv.get_num_threads()}, " in out
    assert "1 thread(s)" in re.search(r"BLAS of prefill's products.*", out).group(0)


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
