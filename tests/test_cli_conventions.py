"""The newcomer's path: what a conversion is and how to serve it, sizes that match the files,
partial conversions said as such, and the command line's conventions."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, run_cli


def rank_dir_bytes(out, rank, ep):
    return sum(p.stat().st_size for p in (out / f"rank-{rank:05d}-of-{ep:05d}").iterdir())


def written_bytes(out):
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and ".megamoe" not in p.relative_to(out).parts)


# ----------------------------------------------------------------------------- inspect: sizes, conversions


def test_inspect_sizes_are_the_bytes_convert_writes(tiny_ckpt, tiny_converted):
    """Per rank and in all: the pre-baked shared expert, logical ids and headers are counted."""
    info = json.loads(run_cli("inspect", tiny_ckpt, "--ep-size", 4, "--num-redundant-experts", 4, "--json").stdout)
    sizes = info["conversion"]
    for rank in range(4):
        assert sizes["rank_bytes"][str(rank)] == rank_dir_bytes(tiny_converted, rank, 4)
    manifest_bytes = (tiny_converted / "manifest.json").stat().st_size
    assert sizes["total_bytes"] == written_bytes(tiny_converted) - manifest_bytes
    routed_only = info["expert_bytes"] * 12 // 8 // 4  # 3 of 12 slots per rank, routed tensors only
    assert sizes["expert_bytes_per_rank"] > routed_only  # the shared expert was not counted before
    assert f"{sizes['expert_bytes_per_rank'] / 1e3:.1f} KB per rank" in run_cli(
        "inspect", tiny_ckpt, "--ep-size", 4, "--num-redundant-experts", 4).stdout


def test_inspect_without_ep_size_works_and_lists_the_ep_sizes_that_work(tmp_path):
    src = tmp_path / "src"
    run_cli("synth", src, "--experts", 6, "-q")  # 6 experts: the old hidden --ep-size 8 failed
    info = json.loads(run_cli("inspect", src, "--json").stdout)
    assert info["working_ep_sizes"]["vllm"] == [1, 2, 3, 6] and "conversion" not in info
    assert "1, 2, 3, 6" in run_cli("inspect", src).stdout
    proc = run_cli("convert", src, tmp_path / "out", "--ep-size", 4, check=False)
    assert proc.returncode == 2 and "not divisible by ep_size=4" in proc.stderr
    assert "EP sizes that work for every selected MoE layer: 1, 2, 3, 6" in proc.stderr


def test_inspect_of_a_conversion_says_what_it_is_and_how_to_serve_it(tiny_converted):
    text = run_cli("inspect", tiny_converted).stdout
    assert "a megamoe conversion" in text and "vllm, EP 4" in text and "all of 4" in text
    command = (f"vllm serve {tiny_converted.resolve()} --load-format megamoe --data-parallel-size 4 "
               "--enable-expert-parallel --moe-backend deep_gemm_mega_moe --enable-eplb "
               "--eplb-config '{\"num_redundant_experts\": 4}'")
    assert command in text
    info = json.loads(run_cli("inspect", tiny_converted, "--json").stdout)
    assert info["kind"] == "conversion" and info["ep_size"] == 4 and info["ranks"] == [0, 1, 2, 3]
    assert info["engine"] == "vllm" and info["num_redundant_experts"] == 4 and info["placement"] == "default"
    assert info["partial"] is False and info["servable"] is True and info["path"] == str(tiny_converted.resolve())
    assert info["serve"]["vllm"] == {"servable": True, "command": command, "reason": "",
                                     "notes": ["vLLM 0.30-0.33; one process per GPU (EP over data parallel)"]}
    assert info["serve"]["sglang"]["servable"] is False and "--engine sglang" in info["serve"]["sglang"]["reason"]
    assert info["sizes"]["total_bytes"] == written_bytes(tiny_converted)
    # the command's flags are vLLM's: their names are checked against the real parser in tests/engines


def test_inspect_of_an_sglang_conversion_gives_sglangs_command(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    run_cli("synth", src, "-q")
    # tiny has hidden 256 (SGLang needs a multiple of 512): the conversion says why it cannot be served
    run_cli("convert", src, out, "--ep-size", 2, "--engine", "sglang", "-q")
    info = json.loads(run_cli("inspect", out, "--json").stdout)
    assert info["serve"]["sglang"]["servable"] is False
    assert "hidden_size=256 is not a multiple of 512" in info["serve"]["sglang"]["reason"]
    assert info["serve"]["vllm"]["servable"] is False and "converted for sglang" in info["serve"]["vllm"]["reason"]


def test_partial_conversions_say_so_everywhere(tiny_ckpt, tmp_path):
    cases = {"ranks": ("--ranks", "0"), "layers": ("--layers", "0,mtp"), "experts_only": ("--experts-only",)}
    for name, args in cases.items():
        out = tmp_path / name
        proc = run_cli("convert", tiny_ckpt, out, "--ep-size", 2, *args)
        done = [l for l in proc.stderr.splitlines() if l.startswith("done:")][0]
        assert "partial:" in done, done
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["coverage"]["partial"] is True and manifest["coverage"]["servable"] is False
        verdict = run_cli("verify", out).stdout
        assert "OK" in verdict and "partial conversion" in verdict and "not servable" in verdict
        report = json.loads(run_cli("verify", out, "--json").stdout)
        assert report["ok"] is True and report["partial"] is True and report["servable"] is False
        info = json.loads(run_cli("inspect", out, "--json").stdout)
        assert info["partial"] is True and info["serve"]["vllm"]["servable"] is False
        assert info["serve"]["vllm"]["command"] == ""
    assert "holds ranks 0 of EP 2, not 1" in json.loads((tmp_path / "ranks" / "manifest.json").read_text())[
        "coverage"]["note"]
    assert "missing layers.1" in json.loads((tmp_path / "layers" / "manifest.json").read_text())["coverage"]["note"]
    full = tmp_path / "full"
    proc = run_cli("convert", tiny_ckpt, full, "--ep-size", 2)
    assert "partial:" not in proc.stderr and f"serve it: megamoe inspect {full}" in proc.stderr
    assert "a complete conversion" in run_cli("verify", full).stdout


# ----------------------------------------------------------------------------- verify's usage errors


def test_verify_of_a_source_checkpoint_is_a_usage_error(tiny_ckpt):
    proc = run_cli("verify", tiny_ckpt, check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert f"{tiny_ckpt} is a source checkpoint, not a conversion" in proc.stderr
    assert "megamoe inspect" in proc.stderr


def test_verify_with_a_missing_source_fails_before_hashing(tiny_converted):
    proc = run_cli("verify", tiny_converted, "--source", "/nonexistent", check=False)
    assert proc.returncode == 2 and "/nonexistent" in proc.stderr
    assert "verify: hash" not in proc.stderr  # no phase started


# ----------------------------------------------------------------------------- conventions


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
    done = [l for l in proc.stderr.splitlines() if l.startswith("done:")]
    assert len(done) == 1 and len(done[0]) > 200 and done[0].rstrip().endswith("convert or pull them)")


@pytest.mark.parametrize("sig,code,word", [(signal.SIGTERM, 143, "terminated")])  # SIGINT: test_reliability
def test_sigterm_stops_like_ctrl_c(tiny_ckpt, tmp_path, sig, code, word):
    """`timeout` and Kubernetes send SIGTERM: the same clean stop as Ctrl-C (no partial file, a
    resume hint, OUT refused as unfinished), exit 143; the rerun completes it."""
    out, release = tmp_path / "out", tmp_path / "release"
    cmd = [sys.executable, "-m", "megamoe_convert.cli", "convert", str(tiny_ckpt), str(out), "--ep-size", "2",
           "--workers", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "MEGAMOE_FAULT": f"wait-after-files=2:{release}"})
    journal = out / ".megamoe" / "journal.jsonl"
    deadline = time.monotonic() + 60
    while not (journal.exists() and len(journal.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline and proc.poll() is None, "convert did not get going"
        time.sleep(0.05)
    proc.send_signal(sig)
    time.sleep(0.5)
    release.touch()
    assert proc.wait(timeout=120) == code
    stderr = proc.stderr.read()
    assert f"{word}" in stderr and "rerun the same command to resume" in stderr and "Traceback" not in stderr
    assert not list(out.rglob("*.partial")) and not (out / "manifest.json").exists()
    run_cli("convert", tiny_ckpt, out, "--ep-size", 2, "--workers", 1)
    assert run_cli("verify", out).returncode == 0


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
