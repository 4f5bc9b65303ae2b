"""SIGTERM (``timeout``, Kubernetes) at any moment of a command, its start-up included: one line
and exit 143, never a traceback, never Ctrl-C's 130 or a bare 1, nothing half-written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO

#: Seconds after the start, every 0.2 s: the interpreter's and the command line's imports, building the
#: app, parsing, the command's own deferred imports as its body starts, and the conversion itself (held
#: in flight by the fault hook until the signal).
DELAYS = (0.1, *(round(0.2 * step, 1) for step in range(1, 16)))


@pytest.mark.parametrize("delay", DELAYS)
def test_sigterm_at_any_moment_exits_143_with_one_line(tiny_ckpt, tmp_path, delay):
    env = {**os.environ, "MEGAMOE_FAULT": f"wait-after-files=1:{tmp_path / 'never'}", "COLUMNS": "200"}
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
