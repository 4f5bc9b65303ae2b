"""SIGTERM (``timeout``, Kubernetes) at any moment of a command, its start-up included: one line
and exit 143, never a traceback, never Ctrl-C's 130 or a bare 1, nothing half-written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, run_cli

#: Seconds after the start, every 0.2 s: the interpreter's and the command line's imports, building the
#: app, parsing, the command's own deferred imports as its body starts, and the conversion itself (held
#: in flight by the fault hook until the signal).
DELAYS = (0.1, *(round(0.2 * step, 1) for step in range(1, 16)))


@pytest.mark.parametrize("delay", DELAYS)
def test_sigterm_at_any_moment_exits_143_with_one_line(tiny_ckpt, tmp_path, delay):
    env = {**os.environ, "MEGAMOE_TEST_FAULTS": f"wait-after-files=1:{tmp_path / 'never'}", "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "megamoe_convert.cli", "convert", str(tiny_ckpt),
                             str(tmp_path / "out"), "--ep-size", "2", "--no-fsync"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    (tmp_path / "never").touch()  # a worker held by the hook goes on, and sees the stop
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err, err
    if proc.returncode == -signal.SIGTERM:  # before the interpreter ran a line of the tool: the default action
        assert delay < 0.5 and not err.strip(), err
        return
    assert proc.returncode == 143, (proc.returncode, err)
    said = [line for line in err.splitlines() if line.startswith("terminated")]
    assert len(said) == 1 and err.strip().splitlines()[-1] == said[0], err
    out = tmp_path / "out"
    assert not list(out.rglob("*.partial")) and not (out / "manifest.json").exists()  # nothing half-written


def test_a_stop_landing_in_an_import_waits_for_it_then_ends_the_command(tmp_path):
    """An exception raised through an extension's C++ initialiser aborts the process (SIGABRT), so a
    stop in an import is held until the import is done, then ends the command like any other."""
    (tmp_path / "stopped_while_imported.py").write_text(
        "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\nprint('import finished', flush=True)\n")
    script = (
        "import sys, typer\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from megamoe_convert import interrupts\n"
        "from megamoe_convert.cli._run import run_command\n"
        "interrupts.install()\n"
        "def command():\n"
        "    try:\n"
        "        run_command(lambda: __import__('stopped_while_imported'))\n"
        "    except typer.Exit as e:\n"
        "        return e.exit_code\n"
        "    return 0\n"
        "sys.exit(interrupts.stoppable(command))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines() == ["import finished"], proc.stdout
    assert proc.returncode == 143, (proc.returncode, proc.stderr)
    assert proc.stderr.strip().splitlines() == ["terminated (SIGTERM): rerun the same command"], proc.stderr


# ----------------------------------------------------------------------------- mid-run: the same clean stop as Ctrl-C

@pytest.mark.parametrize("sig,code,word", [(signal.SIGTERM, 143, "terminated")])  # SIGINT: test_crashes.py
def test_sigterm_stops_like_ctrl_c(tiny_ckpt, tmp_path, sig, code, word):
    """`timeout` and Kubernetes send SIGTERM: the same clean stop as Ctrl-C (no partial file, a
    resume hint, OUT refused as unfinished), exit 143; the rerun completes it."""
    out, release = tmp_path / "out", tmp_path / "release"
    cmd = [sys.executable, "-m", "megamoe_convert.cli", "convert", str(tiny_ckpt), str(out), "--ep-size", "2",
           "--workers", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "MEGAMOE_TEST_FAULTS": f"wait-after-files=2:{release}"})
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


def test_a_synth_stopped_by_sigterm_removes_its_temporary_folder(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "megamoe_convert.cli", "synth", str(tmp_path / "ckpt"),
                             "--experts", "256", "--layers", "8"], cwd=REPO, stderr=subprocess.PIPE, text=True)
    partial = tmp_path / ".ckpt.partial"
    deadline = time.monotonic() + 120
    while not any(partial.glob("*.safetensors")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.terminate()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "terminated (SIGTERM)" in stderr and "Traceback" not in stderr, stderr
    assert list(tmp_path.iterdir()) == []
