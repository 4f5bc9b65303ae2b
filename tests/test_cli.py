"""The command line itself: version, help of every command, one-line errors."""

from __future__ import annotations

import tomllib

import pytest

import megamoe_convert
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
