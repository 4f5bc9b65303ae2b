"""The command line starts without torch: ``--version`` and every ``-h`` import none, and a command
that needs torch, on a machine whose torch is missing, broken or too old, says so in one line and
what to do, exit 2. Each runs in a fresh interpreter: what it imports is what a user's process imports."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import REPO

from megamoe_convert.cli import _run
from megamoe_convert.cli.application import COMMANDS

#: Runs ``megamoe ARGV`` in this interpreter, then says on its last stderr line whether torch was imported.
PROBE = """
import json, sys
from megamoe_convert.cli import main
code = 0
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"exit": code, "torch": "torch" in sys.modules}), file=sys.stderr)
"""

#: A torch for each way a machine's torch fails: what ``import torch`` raises, or the version it says.
BROKEN_TORCH = {
    "missing": 'raise ModuleNotFoundError("No module named \'torch\'", name="torch")\n',
    "no-cuda-libraries": 'raise OSError("libcudart.so.13: cannot open shared object file")\n',
    "undefined-symbol": 'raise ImportError("torch/_C.so: undefined symbol: cudaGetDriverEntryPointByVersion")\n',
    "too-old": '__version__ = "2.5.1+cu121"\n',
}
#: What each says, beside the advice every one of them ends with.
SAID = {
    "missing": "torch is not installed; megamoe needs torch >= 2.8",
    "no-cuda-libraries": "torch cannot be imported (OSError: libcudart.so.13: cannot open shared object file",
    "undefined-symbol": "torch cannot be imported (ImportError: torch/_C.so: undefined symbol",
    "too-old": "torch 2.5.1+cu121 is older than 2.8",
}
ADVICE = "install the serving engine first"
CPU_BUILD = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def _megamoe(*args: object, pythonpath: Path | None = None) -> tuple[subprocess.CompletedProcess[str], dict]:
    """``megamoe ARGS`` in a fresh interpreter (``pythonpath`` first on its path), and what it imported."""
    env = {"COLUMNS": "200", "PYTHONPATH": f"{pythonpath}:{REPO}" if pythonpath else str(REPO)}
    proc = subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **env}, timeout=300)
    return proc, json.loads(proc.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("args", [["--version"], ["-h"], *([name, "-h"] for name, *_ in COMMANDS)],
                         ids=lambda args: " ".join(args))
def test_version_and_help_import_no_torch(args):
    proc, seen = _megamoe(*args)
    assert seen == {"exit": 0, "torch": False}, proc.stderr
    assert proc.stdout.startswith("megamoe-convert " if args == ["--version"] else "Usage: megamoe")


def test_a_usage_error_imports_no_torch(tmp_path):
    proc, seen = _megamoe("convert", tmp_path / "src", tmp_path / "out", "--ep-size", "0")
    assert seen == {"exit": 2, "torch": False} and "must be at least 1" in proc.stderr


@pytest.fixture(params=sorted(BROKEN_TORCH))
def broken_torch(request, tmp_path) -> tuple[str, Path]:
    """A folder holding a ``torch`` package that fails as the parameter says, to put first on the path."""
    package = tmp_path / "site" / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(BROKEN_TORCH[request.param])
    return request.param, package.parent


def test_help_and_version_need_no_torch(broken_torch):
    _, site = broken_torch
    for args in (["--version"], ["-h"], ["synth", "-h"], ["convert", "-h"]):
        proc, seen = _megamoe(*args, pythonpath=site)
        assert seen["exit"] == 0 and "Traceback" not in proc.stderr, (args, proc.stderr)


@pytest.mark.parametrize("command", ["synth", "inspect", "convert", "verify"])
def test_a_command_on_a_broken_torch_says_what_is_wrong_in_one_line(broken_torch, command, tmp_path):
    how, site = broken_torch
    out = tmp_path / "out"
    args = {"synth": [out], "inspect": [tmp_path], "convert": [tmp_path, out, "--ep-size", "2"],
            "verify": [tmp_path]}[command]
    proc, seen = _megamoe(command, *args, pythonpath=site)
    said = proc.stderr.strip().splitlines()[:-1]  # the probe's own line last
    assert seen["exit"] == 2 and len(said) == 1, proc.stderr
    assert said[0].startswith("error: ") and SAID[how] in said[0], said
    assert ADVICE in said[0] and said[0].endswith(CPU_BUILD), said
    assert proc.stdout == "" and not out.exists()


def test_a_broken_torch_is_json_under_json(broken_torch, tmp_path):
    how, site = broken_torch
    proc, seen = _megamoe("inspect", tmp_path, "--json", pythonpath=site)
    error = json.loads(proc.stdout)
    assert seen["exit"] == 2 and error["ok"] is False and error["exit_code"] == 2 and SAID[how] in error["error"]


def test_the_torch_minimum_is_the_one_pyproject_declares():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = next(d for d in declared if re.match(r"torch\b", d))
    assert torch == "torch>=" + ".".join(map(str, _run.TORCH_MINIMUM))
