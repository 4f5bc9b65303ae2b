"""Elastic EP's section of docs/benchmarks.md, from ``benchmarks/results/recovery-*/`` (``bench_recovery.py``):
bringing experts back on a node, every rank at once, from a store against the engines' own ways."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from common import short_gpu, table

RESULTS = Path(__file__).resolve().parent / "results"
#: The method's row name, and what it stands for.
METHODS = {
    "recover_store": "lost experts from the store (megamoe-convert's EPLB recovery)",
    "recover_per_rank": "the same lost experts from a per-rank conversion, each from another rank's file",
    "recover_peer": "the same slots copied from a peer GPU of the node (CUDA copy between devices)",
    "join_store": "a joining rank's every slot from the store",
    "join_checkpoint": "a joining rank's own way: the whole checkpoint read, its slots transformed on the GPU",
}


def runs() -> list[dict[str, Any]]:
    """Every saved run, newest name last."""
    return [json.loads(p.read_text()) for p in sorted(RESULTS.glob("recovery-*/recovery.json"))]


def _median(result: dict[str, Any], method: str, cache: str) -> float | None:
    times = [r["node_s"] for r in result["rows"] if r["method"] == method and r["cache"] == cache]
    return statistics.median(times) if times else None


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f} s" if seconds < 10 else f"{seconds:.1f} s"


def _rows(result: dict[str, Any]) -> list[list[str]]:
    rows = []
    for method, what in METHODS.items():
        warm, cold = _median(result, method, "warm"), _median(result, method, "cold")
        if warm is not None or cold is not None:
            rows.append([f"`{method}`", what, _s(warm), _s(cold)])
    return rows


def summary() -> list[str]:
    """The recovery row of the page's table of other figures (empty without a saved run)."""
    if not (saved := runs()):
        return []
    last = saved[-1]
    store, peer = _median(last, "recover_store", "warm"), _median(last, "recover_peer", "warm")
    return ["experts lost with a failed rank, back from the store (node, warm)", _s(store),
            f"a peer GPU's copy: {_s(peer)}", f"{last['ranks']} x {short_gpu(last['gpu'])}; {last['lost_per_layer']} "
            f"slots x {last['config']['num_hidden_layers']} layers a rank", "[elastic EP](#elastic-ep-experts-back-on-a-node)"]


def section() -> str:
    """Markdown: every method's node time, warm and cold (empty without a saved run)."""
    if not (saved := runs()):
        return ""
    last = saved[-1]
    c = last["config"]
    rows = table(["method", "what it does", "warm", "cold"], _rows(last))
    return f"""## Elastic EP: experts back on a node

`benchmarks/bench_recovery.py` on {last['ranks']} x {last['gpu']}, one process per GPU, every rank released at
once; a node's time is its slowest rank's, median over the rounds. Flash expert dims (H={c['hidden_size']},
I={c['moe_intermediate_size']}, MXFP4), {c['num_hidden_layers']} MoE layers of {c['n_routed_experts']} experts, EP
{last['ep_size']}; the recovery rows bring back {last['lost_per_layer']} slots of every layer on every rank into the
six kernel tensors SGLang's MegaMoE build leaves. Same bytes as the joiner's own way: {'yes' if last['identical']
else 'NO'}.{'' if last.get('cold_dropped') else ' The cold rows ran without dropping the page cache (not root).'}

{rows}
"""
