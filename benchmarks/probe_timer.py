"""The layout probe's time in a benchmark's rank process (``bench_boot.py``, ``bench_node.py``): its
own time, split by its steps, and how long the load waited for it."""

from __future__ import annotations

import contextlib
import operator
import threading
import time
from typing import Any, Callable, Iterator
from unittest import mock

#: The layout probe's own steps (``engines/probe.py``'s names), by the part of the report they go to;
#: the rest of the probe's time is the engine's own loading code on the scratch twin.
PROBE_STEPS = {"synthetic_expert": "input", "reference": "reference", "difference": "compare",
               "fingerprints": "fingerprint"}


def _timed(fn: Any, sink: dict[str, float], key: str, combine: Callable[[float, float], float] = operator.add) -> Any:
    """``fn``, each call's seconds combined into ``sink[key]`` (summed; ``max``: the longest)."""
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink[key] = combine(sink.get(key, 0.0), time.perf_counter() - t0)
    return timed


class ProbeTimer:
    """The layout probe's own time (it runs beside the first reads): vLLM's loading code on one
    synthetic expert per contract, timed where the install driver starts it, split by its steps;
    and how long the load waited for its word (the reads' first writes, and the install's end, wait
    on it): the part of the probe on the rank's critical path."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls = 0
        self.waits: dict[str, float] = {}
        #: Per thread: inside the install's probe (its steps count), inside the early probe (nothing does).
        self._inside = threading.local()

    def _within(self, fn: Any, key: str, where: str, sets: str = "") -> Any:
        """``fn``, its seconds summed into ``seconds[key]`` where this thread is inside ``where`` (``""``:
        anywhere) and not inside the early probe; ``sets``: what a call of it is inside."""
        def timed(*args: Any, **kwargs: Any) -> Any:
            inside = self._inside
            counted = (not where or getattr(inside, where, False)) and not getattr(inside, "early", False)
            if sets:
                setattr(inside, sets, True)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if sets:
                    setattr(inside, sets, False)
                if counted:
                    self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0
        return timed

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        """The install's probe (``probe_s``) and its steps, timed only within it: the steps a thread of
        the model build ran ahead (``probe.prepare``) and the early probe's are not the install's."""
        from megamoe_convert.engines import driver

        probe, start = driver.layout_probe, driver.layout_probe.in_background

        def started(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            future = start(*args, **kwargs)  # what the install's lanes and its end wait on:
            future.result = _timed(future.result, self.waits, "longest", max)  # type: ignore[method-assign]
            return future

        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(driver, "probe_layouts",
                                                  self._within(driver.probe_layouts, "probe", "", sets="probe")))
            stack.enter_context(mock.patch.object(probe, "in_background", started))
            for name, part in PROBE_STEPS.items():
                stack.enter_context(mock.patch.object(probe, name, self._within(getattr(probe, name), part, "probe")))
            yield

    @contextlib.contextmanager
    def while_building(self) -> Iterator[None]:
        """The probe the model build starts (``early_probe``), its own time on its thread timed
        (``probe_early_s``): enter before the model is built."""
        from megamoe_convert.engines import early_probe

        early = self._within(early_probe._probe, "early", "", sets="early")
        with mock.patch.object(early_probe, "_probe", early):
            yield

    def report(self) -> dict[str, Any]:
        if not self.calls:
            return {}
        parts = {part: round(self.seconds.get(part, 0.0), 4) for part in PROBE_STEPS.values()}
        parts["engine"] = round(self.seconds.get("probe", 0.0) - sum(parts.values()), 4)
        from megamoe_convert.engines import early_probe

        early = early_probe.started()  # the probe the model build started (the install's then found it passed)
        return {"probe_s": self.seconds.get("probe", 0.0), "probe_calls": self.calls,
                **({"probe_early_s": self.seconds["early"]} if "early" in self.seconds else {}),
                "probe_wait_s": self.waits.get("longest", 0.0), "probe_parts_s": parts,
                "probe_while_building": early is not None and early.done() and early.exception() is None}
