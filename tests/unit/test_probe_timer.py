"""benchmarks/probe_timer.py: the install's probe and its steps are timed only where the install runs
them, never the early probe's run nor the steps a thread of the model build makes ahead."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from probe_timer import ProbeTimer  # noqa: E402

from megamoe_convert.engines import driver, early_probe, probe  # noqa: E402

STEP_S = 0.02


@pytest.fixture
def fakes(monkeypatch):
    """The probe's entry points made to sleep: one compare step inside each probe run."""
    def compare(*args, **kwargs):
        time.sleep(STEP_S)

    def probe_layouts(*args, **kwargs):
        probe.difference()  # the step, looked up as the real probe looks it up: on the module
        time.sleep(STEP_S)

    def early(*args, **kwargs):
        driver.probe_layouts()  # as early_probe._probe imports it: at its call

    monkeypatch.setattr(probe, "difference", compare)
    monkeypatch.setattr(driver, "probe_layouts", probe_layouts)
    monkeypatch.setattr(early_probe, "_probe", early)


def test_the_early_probe_counts_as_its_own_not_as_the_installs(fakes):
    timer = ProbeTimer()
    with timer.while_building(), timer.timing():
        early_probe._probe()
    assert timer.seconds["early"] >= 2 * STEP_S
    assert timer.seconds.get("probe", 0.0) == 0.0 and timer.seconds.get("compare", 0.0) == 0.0


def test_the_installs_probe_and_its_steps_count_and_a_step_made_ahead_does_not(fakes):
    timer = ProbeTimer()
    with timer.while_building(), timer.timing():
        probe.difference()  # a thread of the model build making a step ahead, outside any probe
        driver.probe_layouts()
    assert timer.seconds["probe"] >= 2 * STEP_S
    assert STEP_S <= timer.seconds["compare"] < 2 * STEP_S  # the install's step alone
    assert "early" not in timer.seconds
