"""The ``MEGAMOE_*`` settings (megamoe_convert/settings.py): read when used, checked when read, and a
bad one refused by every command in one line naming the variable and what it accepts, exit 2."""

from __future__ import annotations

import json
import re

import pytest
from conftest import REPO, run_cli

from megamoe_convert import faults, settings
from megamoe_convert.errors import SettingError
from megamoe_convert.serve import staging

#: A bad value of each setting, what the one line says, and the command that meets it.
BAD = [
    ("MEGAMOE_READ_THREADS", "0", "expected an integer in 1..256", "inspect"),
    ("MEGAMOE_READ_THREADS", "lots", "expected an integer in 1..256", "plan"),
    ("MEGAMOE_CUDART", "2", "expected 0 (off) or 1 (on)", "verify"),
    ("MEGAMOE_FAST_PIN", "yes", "expected 0 (off) or 1 (on)", "convert"),
    ("MEGAMOE_LAYOUT_PROBE", "off", "expected 0 (off) or 1 (on)", "inspect"),
    ("MEGAMOE_STAGED_REST", "no", "expected 0 (off) or 1 (on)", "plan"),
    ("MEGAMOE_TEST_FAULTS", "free-bytes=lots", "expected one fault of kill-after-files=N", "convert"),
]


def _args(command, tiny_ckpt, tiny_converted, out):
    return {"inspect": [tiny_ckpt], "plan": [tiny_ckpt, "--ep-size", 2], "verify": [tiny_converted],
            "convert": [tiny_ckpt, out, "--ep-size", 2]}[command]


@pytest.mark.parametrize("name,value,accepts,command", BAD, ids=[f"{n}={v}" for n, v, _, _ in BAD])
def test_a_bad_setting_is_one_line_naming_it(tiny_ckpt, tiny_converted, tmp_path, name, value, accepts, command):
    out = tmp_path / "out"
    proc = run_cli(command, *_args(command, tiny_ckpt, tiny_converted, out), check=False, env={name: value})
    assert proc.returncode == 2 and proc.stdout == ""
    said = proc.stderr.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(f"error: {name}={value!r}: {accepts}"), proc.stderr
    assert not out.exists()  # said before any work


def test_a_bad_setting_is_json_under_json(tiny_ckpt):
    proc = run_cli("inspect", tiny_ckpt, "--json", check=False, env={"MEGAMOE_CUDART": "on"})
    error = json.loads(proc.stdout)
    assert proc.returncode == 2 and error == {"ok": False, "error": "MEGAMOE_CUDART='on': expected 0 (off) or 1 (on)",
                                              "exit_code": 2}


def test_help_is_shown_whatever_the_settings(tiny_ckpt):
    proc = run_cli("convert", "-h", env={"MEGAMOE_READ_THREADS": "0"})
    assert proc.stdout.startswith("Usage: megamoe convert")


def test_settings_are_read_when_used_not_at_import(monkeypatch):
    monkeypatch.setenv("MEGAMOE_READ_THREADS", "3")
    assert settings.read_threads() == 3 and staging.lane_shape(100, cold=False) == staging.LaneShape(3, 1)
    assert staging.lane_shape(100, cold=True).lanes == 6  # a cold load runs twice as many
    monkeypatch.setenv("MEGAMOE_READ_THREADS", "256")
    assert settings.read_threads() == 256
    monkeypatch.setenv("MEGAMOE_FAST_PIN", "1")
    monkeypatch.setenv("MEGAMOE_CUDART", "0")
    assert settings.fast_pin() and not settings.cudart()


def test_unset_or_empty_is_the_default(monkeypatch):
    for name in settings.NAMES:
        monkeypatch.setenv(name, "")
    assert 4 <= settings.read_threads() <= 16
    assert not settings.fast_pin()  # torch's pinned allocator, unless asked
    assert settings.cudart() and settings.layout_probe() and settings.staged_rest()
    assert settings.injected_fault() is None
    for name in settings.NAMES:
        monkeypatch.delenv(name)
    settings.check()


@pytest.mark.parametrize("name,value", [
    ("MEGAMOE_READ_THREADS", "257"), ("MEGAMOE_READ_THREADS", "-1"), ("MEGAMOE_READ_THREADS", "²"),
    ("MEGAMOE_READ_THREADS", " 4"), ("MEGAMOE_FAST_PIN", "true"), ("MEGAMOE_CUDART", "01"),
    ("MEGAMOE_LAYOUT_PROBE", "no"), ("MEGAMOE_STAGED_REST", "2"),
])
def test_each_setting_accepts_only_its_values(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingError, match=f"^{name}={value!r}: expected "):
        settings.check()


@pytest.mark.parametrize("spec,fault", [
    ("kill-after-files=3", settings.Fault("kill-after-files", 3)),
    ("kill-before-rename=manifest.json", settings.Fault("kill-before-rename", name="manifest.json")),
    ("wait-after-files=2:/tmp/release", settings.Fault("wait-after-files", 2, "/tmp/release")),
    ("free-bytes=1000000", settings.Fault("free-bytes", 1000000)),
])
def test_a_fault_is_read_as_written(monkeypatch, spec, fault):
    monkeypatch.setenv("MEGAMOE_TEST_FAULTS", spec)
    assert settings.injected_fault() == fault


@pytest.mark.parametrize("spec", ["kill-now", "kill-after-files", "kill-after-files=-1", "kill-before-rename=",
                                  "wait-after-files=2", "wait-after-files=x:/tmp/r", "free-bytes=1:/tmp"])
def test_a_fault_not_as_written_is_refused(monkeypatch, spec):
    monkeypatch.setenv("MEGAMOE_TEST_FAULTS", spec)
    with pytest.raises(SettingError, match="^MEGAMOE_TEST_FAULTS=.*: expected one fault of kill-after-files=N, "):
        settings.injected_fault()


def test_a_faults_counts_start_afresh_for_another_fault_and_a_new_command(monkeypatch):
    monkeypatch.setenv("MEGAMOE_TEST_FAULTS", "enospc-after-bytes=10")
    faults.reset()
    faults.wrote(6)
    with pytest.raises(OSError, match="No space left"):
        faults.wrote(6)
    monkeypatch.setenv("MEGAMOE_TEST_FAULTS", "enospc-after-bytes=11")  # another fault: its own count
    faults.wrote(6)
    faults.reset()  # a new command
    faults.wrote(6)
    monkeypatch.delenv("MEGAMOE_TEST_FAULTS")
    faults.wrote(1 << 40)
    assert faults.free_bytes(123) == 123


def test_the_settings_are_read_in_one_module_and_each_is_documented():
    readers = [f"{path.relative_to(REPO)}:{n}" for path in sorted((REPO / "megamoe_convert").rglob("*.py"))
               if path.name != "settings.py"
               for n, line in enumerate(path.read_text().splitlines(), 1)
               if re.search(r"os\.environ|getenv\(", line) and "MEGAMOE" in line]
    assert not readers, readers
    table = (REPO / "docs" / "architecture.md").read_text().split("## Settings")[1].split("\n## ")[0]
    assert [name for name in settings.NAMES if f"| `{name}` |" not in table] == []
