"""The command line itself: version, help of every command, one-line errors."""

from __future__ import annotations

import io
import json
import tomllib

import pytest
from rich.console import Console

import megamoe_convert
import megamoe_convert.cli
from megamoe_convert import ui
from conftest import REPO, run_cli

COMMANDS = ("synth", "inspect", "plan", "convert", "verify", "push", "pull", "merge")


def test_version_answers_without_a_command():
    proc = run_cli("--version")
    assert proc.stdout.strip() == f"megamoe-convert {megamoe_convert.__version__}"


def test_package_version_is_the_projects():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert megamoe_convert.__version__ == project["version"]


def test_top_level_help_lists_every_command():
    out = run_cli("--help", env={"COLUMNS": "200"}).stdout
    for command in COMMANDS:
        assert f" {command} " in out, command


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_explains_itself(command):
    proc = run_cli(command, "--help", env={"COLUMNS": "200"})
    assert "Usage: megamoe " + command in " ".join(proc.stdout.split())
    assert "--" in proc.stdout  # its options are listed


def test_unknown_command_is_a_clear_usage_error():
    proc = run_cli("frobnicate", check=False)
    assert proc.returncode == 2 and "No such command" in proc.stderr and "Traceback" not in proc.stderr


def test_plain_progress_counts_files_and_bytes(tmp_path):
    """Off a terminal (CI logs): a start line with the totals, then done/total files and percent."""
    proc = run_cli("synth", tmp_path / "ckpt", "--preset", "tiny")
    shards = len(list((tmp_path / "ckpt").glob("model-*.safetensors")))
    lines = [line for line in proc.stderr.splitlines() if line.startswith("synth tiny:")]
    assert lines[0].startswith(f"synth tiny: {shards} files, ")
    assert lines[-1] == f"synth tiny: {shards}/{shards} files, 100.0%"
    proc = run_cli("convert", tmp_path / "ckpt", tmp_path / "out", "--ep-size", 2, "--json")
    written = json.loads(proc.stdout)["files_written"]
    assert f"convert: {written}/{written} files, 100.0%" in proc.stderr.splitlines()
    # verify: a second phase (against the source) with its own count of steps, to the end
    proc = run_cli("verify", tmp_path / "out", "--source", tmp_path / "ckpt", "--numerics")
    phase = [line for line in proc.stderr.splitlines() if line.startswith("verify vs source:")]
    steps = int(phase[0].split()[3])
    assert steps > 0 and phase[-1] == f"verify vs source: {steps}/{steps} steps, 100.0%"


def test_terminal_progress_shows_files_beside_bytes(monkeypatch):
    """On a terminal: one rich bar in bytes (speed, ETA) with a done/total files column."""
    console = Console(file=io.StringIO(), force_terminal=True, width=200, color_system=None)
    monkeypatch.setattr(ui, "err_console", console)
    with ui.ByteProgress("convert") as progress:
        progress.start(3_000_000, 3)
        for n in range(3):
            progress.advance(500_000, f"f{n}", False, files=0)  # inside a file: bytes only
            progress.advance(500_000, f"f{n}", skipped=False)
    text = console.file.getvalue()
    assert "3/3 files" in text and "3.0/3.0 MB" in text and "4/3" not in text


@pytest.mark.parametrize("command", COMMANDS)
def test_help_at_80_columns_shows_every_option_name_whole(command):
    """80 columns is what a pipe or a CI log gets: no option name may be cut short there."""
    import typer.main

    click_command = typer.main.get_command(megamoe_convert.cli.app).commands[command]
    names = [opt for param in click_command.params for opt in param.opts if opt.startswith("--")]
    text = run_cli(command, "--help", env={"COLUMNS": "80"}).stdout
    assert names and all(name in text for name in names), [n for n in names if n not in text]
    assert max(map(len, text.splitlines())) <= 80
