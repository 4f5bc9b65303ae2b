"""A conversion or a synth killed (SIGKILL) or stopped (Ctrl-C) at any moment, in a process of its
own: what it leaves is refused as unfinished, never read as finished, and the rerun of the same
command gives a clean run's bytes.

Faults are injected through ``MEGAMOE_TEST_FAULTS`` (megamoe_convert/faults.py); the SIGKILLs land
between files, in the middle of one, before a rename, and at a random byte of the run.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO, output_files, run_cli, run_cli_process
from damage import CONVERT_ARGS, EP2, RANK0, cli_cmd, one_line_refusal

from megamoe_convert.errors import MegamoeError
from megamoe_convert.serve.loader import load_rank
from megamoe_convert.source.checkpoint import Checkpoint
from megamoe_convert.verify import verify


def assert_refused_as_unfinished(out: Path) -> None:
    assert not (out / "manifest.json").exists()
    with pytest.raises(MegamoeError, match="not a finished megamoe conversion"):
        load_rank(out, 0)
    report = verify(out)
    assert not report.ok and "not a finished megamoe conversion" in str(report.problems[0])


# ----------------------------------------------------------------------------- convert

KILL_POINTS = [
    "kill-after-files=1", "kill-after-files=3", "kill-after-files=6", "kill-after-files=8",  # between files
    "kill-after-bytes=5000", "kill-after-bytes=400000", "kill-after-bytes=1500000",  # in the middle of files
    "kill-after-bytes=2900000",
    "kill-before-rename=config.json",  # at the start
    "kill-before-rename=layers.1.safetensors",  # a rank shard complete but not yet in place
    "kill-before-rename=model.safetensors.index.json",  # after every shard, before the index
    "kill-before-rename=manifest.json",  # the manifest write itself
]


@pytest.mark.parametrize("fault", KILL_POINTS)
def test_sigkill_then_rerun_gives_the_clean_bytes(tiny_ckpt, tmp_path, clean, fault):
    out = tmp_path / "out"
    proc = subprocess.run(cli_cmd("convert", tiny_ckpt, out, *CONVERT_ARGS), capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "MEGAMOE_TEST_FAULTS": fault}, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert_refused_as_unfinished(out)
    run_cli("convert", tiny_ckpt, out, *CONVERT_ARGS)
    assert output_files(out) == clean[0]
    assert not list(out.rglob(".*.partial"))


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_sigkill_at_a_random_moment_then_rerun_gives_the_clean_bytes(tiny_ckpt, tmp_path, clean, seed):
    """The moment is a random byte of everything the run writes (the manifest included), so it
    lands inside the run every time; a wall-clock delay would mostly hit start-up or the end."""
    out = tmp_path / "out"
    total = sum(len(data) for data in clean[0].values())
    at = random.Random(seed).randint(1, total)
    proc = run_cli_process("convert", tiny_ckpt, out, *CONVERT_ARGS, check=False,
                           env={"MEGAMOE_TEST_FAULTS": f"kill-after-bytes={at}"})
    assert proc.returncode == -signal.SIGKILL, f"not killed at byte {at} of {total}"
    assert_refused_as_unfinished(out)
    run_cli("convert", tiny_ckpt, out, *CONVERT_ARGS)
    assert output_files(out) == clean[0]
    assert not list(out.rglob(".*.partial"))


def test_ctrl_c_stops_cleanly_and_the_rerun_resumes(tiny_ckpt, tmp_path, clean):
    """SIGINT (Ctrl-C) mid-run: exit 130 with a hint to rerun, no temporary file left, the directory
    refused as unfinished; the same command then completes it with a clean run's bytes."""
    out, release = tmp_path / "out", tmp_path / "release"
    proc = subprocess.Popen(cli_cmd("convert", tiny_ckpt, out, *CONVERT_ARGS), cwd=REPO, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "MEGAMOE_TEST_FAULTS": f"wait-after-files=2:{release}"})
    journal = out / ".megamoe" / "journal.jsonl"
    deadline = time.monotonic() + 60
    while not (journal.exists() and len(journal.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline and proc.poll() is None, "convert did not get going"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    release.touch()  # let the held worker see the cancellation
    code = proc.wait(timeout=120)
    stderr = proc.stderr.read()
    assert code == 130, stderr[-3000:]
    assert "interrupted" in stderr and "rerun" in stderr and "Traceback" not in stderr
    assert not list(out.rglob("*.partial"))
    assert_refused_as_unfinished(out)
    run_cli("convert", tiny_ckpt, out, *CONVERT_ARGS)
    assert output_files(out) == clean[0]


# ----------------------------------------------------------------------------- synth

def test_synth_killed_midway_leaves_no_checkpoint(tmp_path):
    proc = run_cli_process("synth", tmp_path / "ckpt", check=False,
                           env={"MEGAMOE_TEST_FAULTS": "kill-after-bytes=500000"})
    assert proc.returncode == -9
    assert not (tmp_path / "ckpt").exists()  # only the hidden temporary folder, which a rerun replaces
    run_cli("synth", tmp_path / "ckpt")
    Checkpoint.open(tmp_path / "ckpt")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_a_killed_synth_leaves_nothing_the_rerun_does_not_clean(tmp_path):
    ckpt = tmp_path / "ckpt"
    killed = run_cli_process("synth", ckpt, check=False, env={"MEGAMOE_TEST_FAULTS": "kill-after-bytes=300000"})
    assert killed.returncode == -9 and (tmp_path / ".ckpt.partial").is_dir() and not ckpt.exists()
    run_cli("synth", ckpt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] and not (ckpt / ".megamoe-synth").exists()
    # A folder of the user's under the temporary name is never removed.
    (tmp_path / ".other.partial").mkdir()
    (tmp_path / ".other.partial" / "mine.txt").write_text("mine")
    one_line_refusal(run_cli("synth", tmp_path / "other", check=False), "not made by megamoe synth")
    assert (tmp_path / ".other.partial" / "mine.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- links left in a killed run's output

def test_after_a_killed_run_the_rerun_never_writes_through_a_link(sources, tmp_path):
    out = tmp_path / "out"
    killed = run_cli_process("convert", sources["mx"], out, *EP2, "--workers", 1, check=False,
                             env={"MEGAMOE_TEST_FAULTS": "kill-after-files=4"})
    assert killed.returncode == -9 and not (out / "manifest.json").exists()
    victim = tmp_path / "v"
    victim.mkdir()
    (victim / "layers.1.safetensors").write_text("precious")
    shutil.rmtree(out / RANK0, ignore_errors=True)
    (out / RANK0).symlink_to(victim)
    one_line_refusal(run_cli("convert", sources["mx"], out, *EP2, check=False), RANK0, "symbolic link")
    assert [p.read_text() for p in victim.iterdir()] == ["precious"]
    (out / RANK0).unlink()  # the user removes the link: the rerun finishes the conversion
    run_cli("convert", sources["mx"], out, *EP2)
    assert run_cli("verify", out, "--source", sources["mx"]).returncode == 0
