"""The command line's conventions: help, usage errors in plain words, JSON output, quiet and piped
output, signals, refusals that name what works."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from conftest import run_cli


def test_dash_h_is_help_everywhere():
    assert "Usage: megamoe [OPTIONS] COMMAND" in run_cli("-h").stdout
    for command in ("convert", "verify", "inspect", "merge"):
        assert f"Usage: megamoe {command}" in run_cli(command, "-h").stdout


@pytest.mark.parametrize("command", ["synth", "inspect", "plan", "convert", "verify", "push", "pull", "merge"])
def test_help_reads_like_a_usage_line(command):
    text = run_cli(command, "--help", env={"COLUMNS": "100"}).stdout
    for leak in ("<int", "<str>", "<path>", "<list", "{src}", "{out}", "range>", "<float"):
        assert leak not in text, (leak, text)
    usage = " ".join(text.split("\n\n")[0].split())
    assert re.fullmatch(r"Usage: megamoe \w+ \[OPTIONS\]( [A-Z_]+| \[[A-Z_]+\]\.\.\.)*", usage), usage
    assert "-q, --quiet" in text


def test_command_summaries_are_whole_sentences():
    listing = run_cli("--help", env={"COLUMNS": "80"}).stdout.split("Commands:")[1]
    entries = re.split(r"\n  (?=\w)", "\n" + listing.rstrip())[1:]  # one per command, wrapped lines joined
    assert len(entries) >= 8
    for entry in entries:
        summary = " ".join(entry.split()[1:])
        assert summary.endswith(".") and not summary.endswith("...") and summary.count("(") == summary.count(")")


@pytest.mark.parametrize("args,message", [
    (("convert", "a", "b", "--ep-size", "0"), "Invalid value for '--ep-size': must be at least 1"),
    (("convert", "a", "b", "--ep-size", "x"), "Invalid value for '--ep-size': expected a whole number"),
    (("convert", "a", "b", "--ep-size", "2", "--device", "tpu"), "'tpu' is not one of 'cpu', 'cuda'"),
])
def test_usage_errors_are_in_plain_words(args, message):
    proc = run_cli(*args, check=False)
    assert proc.returncode == 2 and message in proc.stderr
    assert "Value error" not in proc.stderr and "Input should" not in proc.stderr


def test_errors_are_json_under_json(tmp_path):
    proc = run_cli("convert", tmp_path / "missing", tmp_path / "out", "--ep-size", 2, "--json", check=False)
    assert proc.returncode == 2 and "error:" in proc.stderr
    error = json.loads(proc.stdout)
    assert error["ok"] is False and error["exit_code"] == 2 and "missing" in error["error"]
    proc = run_cli("inspect", tmp_path, "--ep-size", "0", "--json", check=False)
    assert proc.returncode == 2 and json.loads(proc.stdout)["error"].endswith("must be at least 1")


def test_json_keys_are_snake_case_booleans_explicit_paths_absolute(tiny_ckpt, tmp_path):
    out = tmp_path / "out"
    summary = json.loads(run_cli("convert", tiny_ckpt, out, "--ep-size", 2, "--json").stdout)
    report = json.loads(run_cli("verify", out, "--json").stdout)
    info = json.loads(run_cli("inspect", tiny_ckpt, "--json").stdout)

    def keys(data):
        if isinstance(data, dict):
            for k, v in data.items():
                if k not in ("rank_bytes", "dims"):  # rank numbers; config.json's own names
                    yield k
                yield from keys(v)
        elif isinstance(data, list):
            for v in data:
                yield from keys(v)

    for doc in (summary, report, info):
        bad = [k for k in keys(doc) if not re.fullmatch(r"[a-z0-9_.]+", k)]
        assert not bad, bad
    assert summary["out"] == str(out.resolve()) and report["out"] == str(out.resolve())
    assert isinstance(summary["merged"], bool) and isinstance(summary["partial"], bool)
    assert summary["seconds"] == round(summary["seconds"], 3)
    assert all(isinstance(e["supported"], bool) for e in info["engines"].values())


def test_quiet_prints_no_progress_or_status(tiny_ckpt, tmp_path):
    proc = run_cli("convert", tiny_ckpt, tmp_path / "out", "--ep-size", 2, "-q")
    assert proc.stderr == "" and proc.stdout == ""
    proc = run_cli("verify", tmp_path / "out", "--quiet")
    assert proc.stderr == "" and "OK" in proc.stdout


def test_piped_output_is_never_soft_wrapped(tiny_ckpt, tmp_path):
    """Off a terminal, rich must not break a long line at 80 columns (CI logs, make demo)."""
    deep = tmp_path / ("a-rather-long-directory-name-" * 4) / "out"
    proc = run_cli("convert", tiny_ckpt, deep, "--ep-size", 2, "--ranks", "0", env={"COLUMNS": ""})
    done = [line for line in proc.stderr.splitlines() if line.startswith("done:")]
    assert len(done) == 1 and len(done[0]) > 200 and done[0].rstrip().endswith("convert or pull them)")


def test_refusal_names_what_works_for_vllm(tiny_ckpt, tmp_path):
    (tmp_path / "p.json").write_text(json.dumps([1, 0, 2, 3, 4, 5, 6, 7]))
    proc = run_cli("convert", tiny_ckpt, tmp_path / "out", "--ep-size", 2, "--placement", tmp_path / "p.json",
                   check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    # the default placement written out as a file is what vLLM builds: accepted
    (tmp_path / "d.json").write_text(json.dumps(list(range(8))))
    run_cli("convert", tiny_ckpt, tmp_path / "out", "--ep-size", 2, "--placement", tmp_path / "d.json", "-q")
    assert shlex.split(json.loads(run_cli("inspect", tmp_path / "out", "--json").stdout)["serve"]["vllm"][
        "command"])[:2] == ["vllm", "serve"]
