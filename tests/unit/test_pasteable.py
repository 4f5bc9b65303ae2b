"""A command the tool prints is one a user can paste: piped, whole on one line whatever ``COLUMNS``
says; on a terminal, whole or broken between its arguments with backslash continuations, never cut
by rich's wrapping. Tables fit ``COLUMNS`` read when they are printed, not when the tool was imported."""

from __future__ import annotations

import io
import json
import shlex

from conftest import run_cli
from rich.console import Console
from rich.table import Table

from megamoe_convert import ui

SERVE = ("vllm serve /models/a-long-folder/DeepSeek-V4-Flash-ep8 --load-format megamoe --data-parallel-size 8 "
         "--enable-expert-parallel --moe-backend deep_gemm_mega_moe --enable-eplb "
         "--eplb-config '{\"num_redundant_experts\": 32}'")


def shell_words(lines: list[str]) -> list[str]:
    """The words a shell reads from pasted lines: a trailing backslash joins the next line."""
    return shlex.split("\n".join(lines).replace(" \\\n", " "))


def terminal(width: int) -> Console:
    return Console(file=io.StringIO(), force_terminal=True, width=width, color_system=None)


def test_piped_serve_command_is_one_whole_line_at_any_columns(tiny_converted):
    command = json.loads(run_cli("inspect", tiny_converted, "--json").stdout)["serve"]["vllm"]["command"]
    assert "--enable-expert-parallel" in command and "--eplb-config" in command
    for columns in (60, 80):
        text = run_cli("inspect", tiny_converted, env={"COLUMNS": str(columns)}).stdout
        assert f"  {command}" in text.splitlines(), text
        table = [line for line in text.splitlines() if line[:1] in "┌│└"]
        assert table and max(map(len, table)) <= columns


def test_command_on_a_narrow_terminal_breaks_only_between_arguments(monkeypatch):
    console = terminal(60)
    monkeypatch.setattr(ui, "out_console", console)
    ui.command(SERVE)
    lines = console.file.getvalue().splitlines()
    assert len(lines) > 2 and all(line.endswith(" \\") for line in lines[:-1]) and not lines[-1].endswith("\\")
    assert max(map(len, lines)) <= 60
    assert shell_words(lines) == shlex.split(SERVE)
    assert any(line.strip() == "--eplb-config '{\"num_redundant_experts\": 32}'" for line in lines)  # flag and value


def test_command_on_a_wide_terminal_is_one_line(monkeypatch):
    console = terminal(len(SERVE) + 2)
    monkeypatch.setattr(ui, "out_console", console)
    ui.command(SERVE)
    assert console.file.getvalue().splitlines() == [f"  {SERVE}"]


def test_an_argument_longer_than_the_terminal_keeps_a_line_of_its_own():
    path = "/models/" + "x" * 90
    lines = ui.command_lines(f"megamoe inspect {path} --ep-size 8", 40)
    assert f"      {path} \\" in lines and shell_words(lines) == ["megamoe", "inspect", path, "--ep-size", "8"]


def test_shell_words_keep_quotes_and_escapes_as_written():
    text = """vllm serve /a\\ b/'c d' --x '{"k": 1}' "e\\" f" """.strip()
    assert " ".join(ui.shell_words(text)) == text
    assert shlex.split(" ".join(ui.shell_words(text))) == shlex.split(text)


def test_status_line_holding_a_command_is_never_broken_on_a_terminal(monkeypatch):
    console = terminal(40)
    monkeypatch.setattr(ui, "err_console", console)
    ui.status("done: /models/out (15 files written); serve it: megamoe inspect /models/out")
    assert console.file.getvalue().splitlines() == [
        "done: /models/out (15 files written); serve it: megamoe inspect /models/out"]


def test_piped_table_fits_columns_set_after_import(monkeypatch, capsys):
    """``COLUMNS`` is read at each print: a command run inside another program honours the one it gets."""
    table = Table()
    table.add_column("row")
    table.add_column("value")
    table.add_row("layout identity", "deepgemm-sm100-mega-moe/1 (routed xxh3_64:8577d0b563c92979) " * 3)
    for columns in (50, 90):
        monkeypatch.setenv("COLUMNS", str(columns))
        ui.out_console.print(table)
        lines = capsys.readouterr().out.splitlines()
        assert max(map(len, lines)) == columns
