"""benchmarks/report_node.py's verdicts against the node's limits, from hand-built ``bench_node.py``
results: each cache is judged where its form and its ceiling both ran."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import report_node  # noqa: E402

EXPERT_BYTES = 6_000_000_000


def row(form: str, cache: str, seconds: float, moved: int = EXPERT_BYTES) -> dict:
    return {"form": form, "cache": cache, "node_wall_s": seconds, "slowest_rank_s": seconds, "read_bytes": 0,
            "expert_bytes": EXPERT_BYTES, "bytes_moved": moved, "ranks": []}


def result(rows: list[dict]) -> dict:
    return {"forms": ["auto", "megamoe_per_rank", "megamoe_store"], "warm_reads": 2,
            "steps": [{"shape": "node-l2", "layers": 2, "ep_size": 4, "ranks": 4, "round": 0, "rows": rows}]}


def test_a_warm_only_run_is_judged_against_its_warm_ceiling():
    rows = [row("auto", "warm", 0.8), row("megamoe_per_rank", "warm", 0.12), row("megamoe_store", "warm", 0.2),
            row("pipe", "warm", 0.15, moved=EXPERT_BYTES * 3 // 2)]  # the pipe moves the rank files whole
    text = report_node.goal_lines(result(rows))
    ceiling = 0.15 * 2 / 3
    assert f"`megamoe`, per-rank form: warm {ceiling / 0.12:.2f}x of the node's ceiling (goal 0.8x: met)" in text
    assert f"`megamoe`, store: warm {ceiling / 0.2:.2f}x of the node's ceiling (goal 0.8x: **not met**)" in text
    assert "cold" not in text and "not measured" not in text
    table, _ = report_node.shape_table(report_node.by_shape(result(rows))["node-l2"], result(rows)["forms"])
    assert f"| ceilings: the disk's parallel read (cold); page cache -> pinned -> device (warm) | not measured | - " \
           f"| | | {ceiling:.3f} | 1.00x | | |" in table


def test_no_ceiling_no_verdict():
    rows = [row("auto", "cold", 5.0), row("megamoe_per_rank", "cold", 4.0), row("megamoe_store", "cold", 4.1)]
    text = report_node.goal_lines(result(rows))
    assert "goals not measured for this shape" in text and "goal 0.9x" not in text


def test_both_caches_judged_where_both_ceilings_ran():
    rows = [row("megamoe_per_rank", "cold", 4.0), row("megamoe_per_rank", "warm", 0.1),
            row("disk_read", "cold", 3.8), row("pipe", "warm", 0.09)]
    text = report_node.goal_lines(result(rows))
    assert ("`megamoe`, per-rank form: cold 0.95x of the disk's parallel read (goal 0.9x: met), "
            "warm 0.90x of the node's ceiling (goal 0.8x: met).") in text
    assert "store" not in text
