"""The layout probe's section of docs/benchmarks.md, from ``benchmarks/results/probe-h100/`` (``bench_probe.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common import short_gpu

RESULTS = Path(__file__).resolve().parent / "results" / "probe-h100"
#: (file, what the first load covers, the run's --experts and --ep-size), smallest first.
RUNS = (("44-layers.json", "44 MoE layers: a whole Flash rank's (43 + MTP)", 32, 1),)
GOAL = 0.05


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.0f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} µs"


def _row(result: dict[str, Any], covers: str, experts: int, ep: int) -> list[str]:
    cost = result.get("gate_wait_share_of_first_load")
    probed = [r["install_s"] for r in result["runs"] if r["method"] == "probed"]
    unprobed = [r["install_s"] for r in result["runs"] if r["method"] == "unprobed"]
    return [covers, f"{experts // ep} ({experts} at EP {ep})", _ms(result["probe_s"]), _ms(result.get("gate_wait_s")),
            _ms(result["first_load_s"]), _added(result),
            f"{cost:.2%}" + (" (met)" if cost < GOAL else " (not met)") if cost is not None else "-",
            f"{min(unprobed) * 1e3:.0f}-{max(unprobed) * 1e3:.0f} / {min(probed) * 1e3:.0f}-{max(probed) * 1e3:.0f} ms",
            "yes" if result["identical"] else "NO"]


def _added(result: dict[str, Any]) -> str:
    """The probed runs' median first load, and how much longer than the unprobed runs' it was."""
    probed = result.get("probed_first_load_s")
    return f"{_ms(probed)} ({result['added_share_of_first_load']:+.1%})" if probed is not None else "-"


def _phases(result: dict[str, Any]) -> str:
    phases = result.get("probe_phases_s") or {}
    names = {"input": "its input", "reference": "this package's layout of it", "engine": "vLLM's own code",
             "compare": "the comparison", "fingerprint": "the fingerprint"}
    return ", ".join(f"{names.get(k, k)} {v * 1e3:.1f} ms" for k, v in phases.items())


def summary() -> list[str]:
    """The probe row of the page's table of other figures."""
    name, covers, _, _ = RUNS[-1]
    result = json.loads((RESULTS / name).read_text())
    return ["the layout probe beside the first load, warm", f"the load waits {_ms(result.get('gate_wait_s'))} for it; "
            f"its own time {_ms(result['probe_s'])}", f"the first load without it: {_ms(result['first_load_s'])}",
            f"1 x {short_gpu(result['gpu'])}; {covers}", "[probe](#the-layout-probe-at-start-up)"]


def section() -> str:
    """Markdown: what the probe adds to the first load it runs beside, and its GPU memory."""
    runs = [(json.loads((RESULTS / name).read_text()), covers, experts, ep) for name, covers, experts, ep in RUNS
            if (RESULTS / name).exists()]
    if not runs:
        return ""
    rows = [_row(*run) for run in runs]
    head = ["first load of", "experts a layer on the rank", "probe's own time", "load's wait for it",
            "first load, unprobed", "first load, probed", f"wait / first load (goal < {GOAL:.0%})", "install: unprobed / probed",
            "same bytes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
    last = runs[-1][0]
    return f"""## The layout probe at start-up

`benchmarks/bench_probe.py` on one {last['gpu']}: vLLM 0.33's real `DeepGemmMegaMoEExperts` modules, Flash
dims (H=4096, I=2048, MXFP4 experts), page cache warm, each run a fresh process, {len(last['runs']) // 2}
with the probe and {len(last['runs']) // 2} without, alternating; medians. The probe runs vLLM's own
`weight_loader` on one synthetic expert on its own thread, beside the load's first reads, and no byte
lands in a module until it has passed: what it adds to the first load is how long the load's lanes
wait for it before their first write. The first load is the install without it; the probed runs'
first load, against it, also counts the probe's thread sharing the CPU with the reads (and the runs'
noise).

{chr(10).join(lines)}

Where the probe's own time goes (last row): {_phases(last)}. Its GPU memory:
{last['probe_gpu_bytes'] / 1e6:.1f} MB at its peak, {last['probe_gpu_bytes_per_expert']:.2f} of one expert's
{last['one_expert_bytes'] / 1e6:.1f} MB. Cold, the first load waits on the disk (seconds: see the node section) and the
probe is a far smaller share.
"""
