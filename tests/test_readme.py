"""The README runs as written.

Every ```python block runs on its own in a fresh interpreter (imports and
inputs included), from the repository root, as a reader pasting it would run
it; every ``python -m numkv`` / ``numkv`` command in a ```bash block parses
(its command and flags exist).  So the README cannot rot.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from numkv.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(language):
    """``(id, code)`` of each fenced block in ``language``; the id names the
    section it sits in (``attention-1``), so a failure says where to look."""
    found, counts, heading = [], {}, "top"
    for match in re.finditer(r"^(#{1,4}) ([^\n]+)$|^```(\w*)\n(.*?)^```$", README, re.M | re.S):
        if match.group(1):
            heading = re.sub(r"[^a-z0-9]+", "-", match.group(2).lower()).strip("-")
        elif match.group(3) == language:
            counts[heading] = counts.get(heading, 0) + 1
            found.append((f"{heading}-{counts[heading]}", match.group(4)))
    return found


PYTHON = _blocks("python")
BASH = _blocks("bash")


def test_the_readme_has_the_blocks_this_test_runs():
    assert len(PYTHON) >= 8 and len(BASH) >= 4


@pytest.mark.parametrize("code", [c for _, c in PYTHON], ids=[i for i, _ in PYTHON])
def test_python_block_runs_on_its_own(code):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def _numkv_commands():
    """Arguments of every ``python -m numkv ...`` or ``numkv ...`` command in
    the README's bash blocks."""
    commands = []
    for block_id, code in BASH:
        for line in code.splitlines():
            line = line.split(" #", 1)[0]
            for part in re.split(r"&&|\|\||;|\|", line):
                words = shlex.split(part)
                while words and re.fullmatch(r"\w+=\S*", words[0]):  # VAR=value prefixes
                    words.pop(0)
                if words[:3] == ["python", "-m", "numkv"]:
                    commands.append((block_id, words[3:]))
                elif words[:1] == ["numkv"]:
                    commands.append((block_id, words[1:]))
    return commands


COMMANDS = _numkv_commands()


def test_the_readme_shows_the_command_line():
    shown = {args[0] for _, args in COMMANDS if args}
    assert {"demo", "info", "warmup", "bench", "--version"} <= shown


@pytest.mark.parametrize("args", [a for _, a in COMMANDS],
                         ids=[f"{b}:{' '.join(a) or '(none)'}" for b, a in COMMANDS])
def test_command_line_in_the_readme_parses(args):
    try:
        build_parser().parse_args(args)
    except SystemExit as exc:  # --help / --version exit 0; a bad flag exits 2
        assert exc.code == 0, f"`numkv {' '.join(args)}` does not parse"


def test_the_test_command_is_what_ci_runs():
    """``.ci/run`` runs exactly the README's test command after installing."""
    block = dict(BASH)["run-the-tests-1"].strip()
    *installs, test = [part.strip() for part in block.split("&&")]
    ci = (ROOT / ".ci" / "run").read_text()
    assert installs
    for install in installs:  # (torch's CPU build, then numkv with its extras)
        assert install.replace("pip install", "python3 -m pip install --quiet") in ci
    assert ci.rstrip().splitlines()[-1] == test.replace("python ", "python3 ")
