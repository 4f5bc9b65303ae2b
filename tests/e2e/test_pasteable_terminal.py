"""The commands the tool prints, as a user sees them in a real terminal (a pseudo-terminal of 80 and
120 columns, no ``COLUMNS``): every serve command and resume hint pastes back into a shell whole."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import shlex
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from conftest import REPO, run_cli

#: What a terminal is told besides its size: no colours, and nothing that sets a width of its own.
UNSET = ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")


def in_terminal(*args: object, columns: int) -> list[str]:
    """``megamoe ARGS...`` with stdin, stdout and stderr on a terminal ``columns`` wide: its lines as
    they were written (a line longer than the terminal is one the terminal itself wraps)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in UNSET} | {"TERM": "xterm", "NO_COLOR": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "megamoe_convert.cli", *map(str, args)], stdin=follower,
                            stdout=follower, stderr=follower, env=env, cwd=REPO)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # the last writer closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=300) == 0, b"".join(chunks).decode(errors="replace")
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode()).replace("\r\n", "\n")
    return [line.rsplit("\r", 1)[-1] for line in text.split("\n")]


def pasted(lines: list[str], first: str) -> tuple[list[str], list[str]]:
    """The words a shell reads when the lines from the one starting with ``first`` are pasted (a
    trailing backslash joins the next line), and those lines."""
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(first))
    end = next(i for i in range(start, len(lines)) if not lines[i].endswith("\\"))
    block = lines[start:end + 1]
    return shlex.split("\n".join(block).replace(" \\\n", " ")), block


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A conversion under a long path, as a real one's: its serve command is wider than 120 columns."""
    root = tmp_path_factory.mktemp("terminal")
    run_cli("synth", root / "ckpt", "-q")
    out = root / "a-long-folder-of-converted-checkpoints" / "DeepSeek-V4-Flash-converted-for-ep4-with-eplb"
    run_cli("convert", root / "ckpt", out, "--ep-size", 4, "--num-redundant-experts", 4, "-q")
    return out


@pytest.mark.parametrize("columns", [80, 120])
def test_serve_command_pastes_from_a_terminal(converted, columns):
    command = json.loads(run_cli("inspect", converted, "--json").stdout)["serve"]["vllm"]["command"]
    assert len(command) > 120
    lines = in_terminal("inspect", converted, columns=columns)
    words, block = pasted(lines, "vllm serve")
    assert words == shlex.split(command)
    for line in block:  # broken only between words: a longer line is one word, which the terminal wraps
        assert len(line) <= columns or len(line.strip().removesuffix(" \\").split()) == 1, line
    assert f"{converted} (a megamoe conversion)" in lines  # the path above the table, whole
    table = [line for line in lines if line[:1] in "┌│├└"]
    assert table and max(map(len, table)) <= columns


def test_convert_done_line_and_resume_hint_stay_whole_in_a_terminal(converted, tmp_path):
    out = tmp_path / "a-second-long-folder-name-for-the-output" / "DeepSeek-V4-Flash-converted-for-ep2"
    lines = in_terminal("convert", converted.parent.parent / "ckpt", out, "--ep-size", 2, columns=80)
    done = next(line for line in lines if line.startswith("done: "))
    assert done.endswith(f"; serve it: megamoe inspect {out}")
    (out / "manifest.json").unlink()
    lines = in_terminal("inspect", out, columns=80)
    hint = next(line for line in lines if line.startswith("next: "))
    resume = hint.split("from where it stopped: ", 1)[1]
    assert shlex.split(resume) == ["megamoe", "convert", str((converted.parent.parent / "ckpt").resolve()),
                                   str(out), "--ep-size", "2"]
