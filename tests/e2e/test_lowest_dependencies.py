"""The dependency bounds of pyproject.toml are true: the lowest version each allows, installed into a
folder of their own (torch aside: it is the one installed, as the engine pins it), runs the command
line: ``--version``, ``-h``, a usage error in plain words, a tiny synth, convert and verify, and the
hub's offline refusal (the hub's own error classes, named where it is refused).

The folder is built once, named by a hash of the pins, beside the engines' environments
(tests/engine_envs.py): a changed bound builds a new one.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from engine_envs import CACHE
from filelock import FileLock

REPO = Path(__file__).resolve().parents[2]
#: What the engine brings, not this package: its own bound is checked by tests/e2e/test_startup.py.
NOT_INSTALLED = {"torch"}


def lowest_pins() -> list[str]:
    """``name==X`` for every ``name>=X`` dependency of pyproject.toml but torch."""
    pins = []
    for requirement in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][0-9A-Za-z.]*)", requirement)
        assert match, f"pyproject.toml: {requirement!r}: expected NAME>=VERSION (a lower bound to test)"
        if match[1] not in NOT_INSTALLED:
            pins.append(f"{match[1]}=={match[2]}")
    return pins


def lowest_environment(pins: list[str]) -> Path:
    """A folder holding ``pins`` and what they depend on (wheels only), built once."""
    target = CACHE.parent / f"lowest-dependencies-{hashlib.sha256(chr(10).join(pins).encode()).hexdigest()[:12]}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not target.is_dir():
            partial = target.with_name(target.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                   "--no-compile", "--only-binary=:all:", "--target", str(partial), *pins],
                                  capture_output=True, text=True)
            assert proc.returncode == 0, f"installing {' '.join(pins)} failed:\n{proc.stdout}\n{proc.stderr}"
            partial.rename(target)
    return target


@pytest.fixture(scope="module")
def lowest() -> Path:
    return lowest_environment(lowest_pins())


def _run(lowest: Path, *args: object, env: dict[str, str] | None = None, code: str | None = None,
         ) -> subprocess.CompletedProcess[str]:
    """``megamoe ARGS`` (or ``python -c CODE``) with the lowest dependencies first on the path."""
    command = ["-c", code] if code is not None else ["-m", "megamoe_convert.cli", *map(str, args)]
    path = {"PYTHONPATH": f"{lowest}{os.pathsep}{REPO}", "COLUMNS": "200"}
    return subprocess.run([sys.executable, *command], capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, **path, **(env or {})})


def _release(version: str) -> tuple[int, ...]:
    """``0.4.0`` as ``(0, 4)``: the same release as ``0.4``."""
    parts = [int(part) for part in version.split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def test_the_lowest_versions_are_the_ones_imported(lowest):
    pins = dict(pin.split("==") for pin in lowest_pins())
    proc = _run(lowest, code="from importlib.metadata import version\n"
                             f"print(' '.join(version(name) for name in {list(pins)!r}))")
    assert proc.returncode == 0, proc.stderr
    assert [_release(v) for v in proc.stdout.split()] == [_release(v) for v in pins.values()], proc.stdout


def test_the_command_line_runs_on_the_lowest_versions(lowest, tmp_path):
    assert _run(lowest, "--version").stdout.startswith("megamoe-convert ")
    assert _run(lowest, "convert", "-h").stdout.startswith("Usage: megamoe convert [OPTIONS] SRC OUT")
    usage = _run(lowest, "convert", tmp_path / "a", tmp_path / "b", "--ep-size", "0")
    assert usage.returncode == 2 and "Invalid value for '--ep-size': must be at least 1" in usage.stderr
    for args in (["synth", tmp_path / "ckpt", "-q"], ["convert", tmp_path / "ckpt", tmp_path / "out", "--ep-size", 2],
                 ["verify", tmp_path / "out"]):
        proc = _run(lowest, *args)
        assert proc.returncode == 0, (args, proc.stderr)
    assert proc.stdout.splitlines()[-1].startswith("OK: no problems found")


def test_the_hubs_refusal_on_the_lowest_versions_is_one_line(lowest, tmp_path):
    proc = _run(lowest, "inspect", "someone/not-in-the-cache",
                env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    said = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(said) == 1 and "HF_HUB_OFFLINE" in said[0], proc.stderr
