"""What both engines' layout-probe tests share: where the engine's own loading code cannot run, the
probe refuses, and the caller's explicit opt-out is served and logged; and a count of the engine's
own code's runs by the probe."""

from __future__ import annotations

import logging
import threading
from typing import Callable

import pytest

from megamoe_convert.engines import probe
from megamoe_convert.errors import InstallError


def assert_refused_unless_opted_out(state: Callable[[], dict], same: Callable[[dict, dict], bool],
                                    install: Callable[[], int], opted_out: Callable[[], int], layers: int,
                                    hint: str, caplog: pytest.LogCaptureFixture) -> None:
    """``install()`` is refused in one line that names the missing piece (``hint``) and the opt-out,
    before any module changes (``state()`` after is ``same`` as before); ``opted_out()`` installs all
    ``layers`` and logs that the layout went unchecked."""
    before = state()
    with pytest.raises(InstallError) as e:
        install()
    assert same(state(), before)
    message = str(e.value)
    assert "\n" not in message and "cannot run the engine's own loading code" in message
    assert hint in message and "MEGAMOE_LAYOUT_PROBE=0" in message
    with caplog.at_level(logging.WARNING):
        assert opted_out() == layers
    assert any("layout probe skipped" in r.getMessage() and "unchecked" in r.getMessage() for r in caplog.records)


def engine_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every run of the engine's own loading code by a layout probe: (its module, the thread it ran on)."""
    runs: list[tuple[str, str]] = []
    made = probe.LayoutProbe

    def counted(engine, where, run, contract=""):
        def counting(inp, shapes):
            runs.append((where, threading.current_thread().name))
            return run(inp, shapes)
        return made(engine, where, counting, contract)

    monkeypatch.setattr(probe, "LayoutProbe", counted)
    return runs
