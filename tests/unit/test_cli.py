"""The command line itself: version, help of every command, one-line errors."""

from __future__ import annotations

import io
import json
import re
import tomllib

import pytest
from conftest import REPO, run_cli
from rich.console import Console

import megamoe_convert
import megamoe_convert.cli
from megamoe_convert import ui

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


def test_top_level_help_lists_commands_in_the_order_a_user_runs_them():
    out = run_cli("--help", env={"COLUMNS": "200"}).stdout
    listed = [line.split()[0] for line in out.split("Commands:")[1].splitlines() if line.strip()]
    assert listed == [*COMMANDS, "preload"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_explains_itself(command):
    proc = run_cli(command, "--help", env={"COLUMNS": "200"})
    assert "Usage: megamoe " + command in " ".join(proc.stdout.split())
    assert "--" in proc.stdout  # its options are listed


def test_unknown_command_is_a_clear_usage_error():
    proc = run_cli("frobnicate", check=False)
    assert proc.returncode == 2 and "No such command" in proc.stderr and "Traceback" not in proc.stderr


def test_plain_progress_counts_files_and_bytes(tmp_path):
    """Off a terminal (CI logs): a start line with the totals, then done/total files and percent, then
    one line per phase with its count, bytes, time and rate."""
    proc = run_cli("synth", tmp_path / "ckpt", "--preset", "tiny")
    shards = len(list((tmp_path / "ckpt").glob("model-*.safetensors")))
    lines = [line for line in proc.stderr.splitlines() if line.startswith("synth tiny:")]
    assert lines[0].startswith(f"synth tiny: {shards} files, ")
    assert re.fullmatch(rf"synth tiny: {shards}/{shards} files finished, ([\d.]+ [KM]B) of \1 \(100.0% of the bytes\)",
                        lines[-2])
    assert re.fullmatch(rf"synth tiny: finished {shards} files, [\d.]+ MB in [\d.]+ s, [\d.]+ [KMG]B/s", lines[-1])
    proc = run_cli("convert", tmp_path / "ckpt", tmp_path / "out", "--ep-size", 2, "--json")
    written = json.loads(proc.stdout)["files_written"]
    assert any(re.fullmatch(rf"convert: {written}/{written} files finished, ([\d.]+ [KM]B) of \1 \(100.0% of the "
                            r"bytes\)", line) for line in proc.stderr.splitlines())
    # verify: hashing (bytes), the comparison with the source (bytes) and numerics (layers: a
    # compute-bound phase) are phases of their own, each with its own unit and time
    proc = run_cli("verify", tmp_path / "out", "--source", tmp_path / "ckpt", "--numerics")
    err = proc.stderr.splitlines()
    phases = [line.split(":")[1].strip() for line in err if ": finished " in line]
    assert phases == ["hash", "compare source", "numerics"]
    numerics = [line for line in err if line.startswith("verify: numerics:")]
    assert numerics[0] == "verify: numerics: 3 layers"  # 3 MoE layers, the 2 ranks in turn, no bytes
    assert numerics[-2] == "verify: numerics: 3/3 layers (100.0%)"
    assert re.fullmatch(r"verify: numerics: finished 3 layers in [\d.]+ s, [\d.]+ layers/s", numerics[-1])
    table = proc.stdout
    assert re.search(r"time: hashed\s+│ [\d.]+ MB in [\d.]+ s", table)
    assert re.search(r"time: numerics\s+│ 3 layers in [\d.]+ s", table)
    report = json.loads(run_cli("verify", tmp_path / "out", "--source", tmp_path / "ckpt", "--numerics",
                                "--json").stdout)
    assert set(report["phases"]) == {"hash", "compare_source", "numerics"}
    assert report["phases"]["numerics"]["unit"] == "layers" and report["phases"]["numerics"]["bytes"] is None
    assert report["phases"]["hash"]["bytes"] == report["bytes_hashed"]


def test_convert_speed_counts_only_the_files_written_now(tmp_path, tiny_ckpt):
    """A resumed run: files already done leave the totals (no inflated MB/s), and the done line says
    how many were skipped and the throughput of what was written."""
    out = tmp_path / "out"
    run_cli("convert", tiny_ckpt, out, "--ep-size", 2)
    victims = sorted(out.glob("rank-00001-of-00002/*.safetensors"))
    for victim in victims:
        victim.unlink()
    proc = run_cli("convert", tiny_ckpt, out, "--ep-size", 2)
    n = len(victims)
    assert re.search(rf"convert: {n}/{n} files finished, .* \(100.0% of the bytes\) \(\d+ already done\)",
                     proc.stderr)
    finished = next(line for line in proc.stderr.splitlines() if line.startswith("convert: finished"))
    assert finished.startswith(f"convert: finished {n} files, ") and "already done" in finished
    done = next(line for line in proc.stderr.splitlines() if line.startswith("done:"))
    assert re.search(rf"\({n} files written, \d+ already done, [\d.]+ [KM]B in [\d.]+ s, [\d.]+ [KMG]B/s\)", done)


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


def test_plain_progress_agrees_with_itself_inside_a_file(capsys):
    """Bytes move inside a file long before it is finished: the line says whose percentage it shows."""
    with ui.ByteProgress("convert", plain_interval_s=0) as progress:
        progress.start(10_000_000, 12)
        progress.advance(3_600_000, "rank-00000-of-00004/layers.0.safetensors", False, files=0)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "convert: 12 files, 0.010 GB"
    assert re.fullmatch(r"convert: 0/12 files finished, 3.6 MB of 10.0 MB \(36.0% of the bytes\)"
                        r"(, about \d+ (s|min) left)?", lines[1]), lines[1]


def test_terminal_progress_fits_80_columns(monkeypatch):
    """At 80 columns the bar drops what does not fit (the file's path, speed, elapsed): no line wraps."""
    console = Console(file=io.StringIO(), force_terminal=True, width=80, color_system=None)
    monkeypatch.setattr(ui, "err_console", console)
    with ui.ByteProgress("convert") as progress:
        progress.start(3_000_000_000, 120)
        progress.advance(1_500_000_000, "rank-00012-of-00064/layers.42.safetensors", False, files=60)
    text = console.file.getvalue()
    assert "60/120 files" in text and "1.5/3.0 GB" in text and "layers.42" not in text
    assert max(len(line) for line in re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text))) <= 80


def test_piped_tables_fit_columns_when_it_is_set(tiny_ckpt):
    """Piped, a table is as wide as ``COLUMNS`` says (unbounded without it: the viewer wraps)."""
    narrow = run_cli("inspect", tiny_ckpt, env={"COLUMNS": "60"}).stdout
    wide = run_cli("inspect", tiny_ckpt).stdout
    assert max(map(len, narrow.splitlines())) <= 60 < max(map(len, wide.splitlines()))


@pytest.mark.parametrize("command", COMMANDS)
def test_help_at_80_columns_shows_every_option_name_whole(command):
    """80 columns is what a pipe or a CI log gets: no option name may be cut short there."""
    import typer.main

    click_command = typer.main.get_command(megamoe_convert.cli.app).commands[command]
    names = [opt for param in click_command.params for opt in param.opts if opt.startswith("--")]
    text = run_cli(command, "--help", env={"COLUMNS": "80"}).stdout
    assert names and all(name in text for name in names), [n for n in names if n not in text]
    assert max(map(len, text.splitlines())) <= 80


@pytest.mark.parametrize("command", [*COMMANDS, "preload"])
def test_every_command_help_ends_with_its_examples(command):
    """The docstring's examples show in ``--help`` (after the options), line for line, within 80 columns."""
    text = run_cli(command, "--help", env={"COLUMNS": "80"}).stdout
    options, examples = text.split("\n  Examples:\n")
    assert "-h, --help" in options and "-h, --help" not in examples
    lines = [line.strip() for line in examples.splitlines() if line.strip()]
    assert any(line.startswith(f"megamoe {command} ") for line in lines), lines
    assert max(map(len, text.splitlines())) <= 80
