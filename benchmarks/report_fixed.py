"""docs/benchmarks.md's table of what the plugin adds to a rank process's start beyond the bytes it
moves (``bench_boot.py`` runs): its own steps, the load's wait for the layout probe, and what it
lengthens against the engine's ``auto``; beside them, what ran on the plugin's threads meanwhile."""

from __future__ import annotations

import statistics
from typing import Any

from common import table

#: What the plugin may add to a rank process beyond the bytes it moves, in seconds.
FIXED_COST_GOAL_S = 0.050


def rank_median(rows: list[dict[str, Any]], rank: int, key: str) -> float:
    """The median over rounds of one rank's ``key`` (a phase, or a report field; absent: 0)."""
    return statistics.median(next((r["phases"].get(key, r.get(key, 0.0)) for r in row["ranks"] if r["rank"] == rank),
                                  0.0) for row in rows)


def node_median(rows: list[dict[str, Any]], key: str) -> float:
    """The median of a phase over every rank and round: a form's effect on a phase that varies from rank
    to rank by as much as the forms differ (vLLM's config reading), which one rank against the same rank
    of the other form would take for the plugin's."""
    return statistics.median(r["phases"].get(key, r.get(key, 0.0)) for row in rows for r in row["ranks"])


def reported(rows: list[dict[str, Any]], key: str) -> bool:
    """Whether the rows' ranks report ``key`` (a phase, or a field a later ``bench_boot.py`` added)."""
    return any(key in r["phases"] or key in r for row in rows for r in row["ranks"])


#: What the plugin adds to a rank's critical path: its own steps a megamoe rank reports, the load's wait
#: for the layout probe, and the loader's making against ``auto``'s.
FIXED_FIELDS = (("plugin_import_s", "import"), ("plugin_register_s", "register"),
                ("install_import_s", "first call's imports"), ("probe_wait_s", "the load's wait for the probe"))
FIXED_DELTAS = (("loader", "loader made, over auto"),)
#: Beside them, outside the total: the engine's config reading against ``auto``'s (where the plugin's
#: config hook checks a conversion: a few ms, within what vLLM's reading varies from rank to rank), the
#: probe's own time on its thread (while the model built, and at the install, beside the first reads,
#: where none passed before), and the model build against ``auto``'s, with the staging ring being pinned
#: on a thread meanwhile.
BESIDE = (("config", "engine config, over auto"), ("probe_early_s", "the probe's own time, while the model built"),
          ("probe_s", "the probe's own time, beside the reads"), ("construct", "model build, over auto"),
          ("ring_pin_s", "staging ring pinned beside the build"))


def fixed_costs(got: dict, shape: str, cache: str) -> list[dict[str, float]]:
    """Per rank of ``shape``: the plugin's own cost on a rank process's critical path (each of
    :data:`FIXED_FIELDS`, medians over rounds, and :data:`FIXED_DELTAS`, medians over the node's ranks and
    rounds, and their ``total``; a run that did not time the load's wait counts the probe whole), and
    :data:`BESIDE` (the config reading node-wide, as the loader's making); empty without both forms."""
    ours, auto = got.get((shape, "megamoe", cache)), got.get((shape, "auto", cache))
    if not ours or not auto:
        return []
    out = []
    for rank in sorted({r["rank"] for row in ours for r in row["ranks"]}):
        cost = {key: rank_median(ours, rank, key) for key, _ in FIXED_FIELDS}
        cost["plugin_register_s"] -= rank_median(auto, rank, "engine_plugins_s")  # the engine's own, auto's too
        if not reported(ours, "probe_wait_s"):
            cost["probe_wait_s"] = rank_median(ours, rank, "probe_s")
        cost.update({key: node_median(ours, key) - node_median(auto, key) for key, _ in FIXED_DELTAS})
        beside = {"config": node_median(ours, "config") - node_median(auto, "config"),
                  "probe_early_s": rank_median(ours, rank, "probe_early_s"), "probe_s": rank_median(ours, rank, "probe_s"),
                  "ring_pin_s": rank_median(ours, rank, "ring_pin_s"),
                  "construct": rank_median(ours, rank, "construct") - rank_median(auto, rank, "construct")}
        out.append({"rank": rank, **cost, "total": sum(cost.values()), **beside})
    return out


def _ms(rows: list[dict[str, Any]], key: str, seconds: float) -> str:
    return f"{1e3 * seconds:.1f}" if reported(rows, key) else "not timed"


def fixed_table(got: dict, shapes: list[str]) -> str:
    """Each shape's worst rank process: what the plugin added to its critical path, against the goal,
    and beside it what ran on the plugin's threads while the engine worked."""
    rows = []
    for shape in shapes:
        for cache in ("cold", "warm"):
            costs = fixed_costs(got, shape, cache)
            if not costs:
                continue
            worst = max(costs, key=lambda c: c["total"])
            ours = got[shape, "megamoe", cache]
            rows.append([shape, cache, worst["rank"], *[_ms(ours, k, worst[k]) for k, _ in FIXED_FIELDS + FIXED_DELTAS],
                         f"{1e3 * worst['total']:.1f}", "yes" if worst["total"] < FIXED_COST_GOAL_S else "no",
                         *[_ms(ours, k, worst[k]) for k, _ in BESIDE], _while_building(ours)])
    if not rows:
        return ""
    return ("What the plugin adds to a rank process's critical path beyond the bytes it moves (`megamoe` against "
            "`auto`, ms, the rank with the largest total): its import, `register` (less the engine's own plugin "
            "loading where `auto` timed it: SGLang's `load_plugins` runs in every process), what the first call imports, how "
            "long the load waited for the layout probe (the probe runs on its own thread: beside the first reads, "
            "or while the model builds where the last column says so; a run that did not time the wait counts "
            "the probe whole) and the loader's making (medians over the node's ranks, against `auto`'s). Beside the "
            "total, not in it: the engine's config reading against `auto`'s (medians over the node's ranks: the "
            "plugin's hook checks a conversion there, a few ms, within what the engine's own reading varies from "
            "rank to rank); the probe's own time, while the model built and at the install (which finds a probe passed "
            "during the build and runs none); the model build against `auto`'s, which the staging ring's pinning (on "
            "its own thread, the buffers the bytes move through) lengthens; and that pinning's time. Both forms' "
            "node times include all of it. \"not timed\": a run of a `bench_boot.py` that did not report it, where "
            "it lies in another column:\n\n" +
            table(["shape", "cache", "rank", *[label for _, label in FIXED_FIELDS + FIXED_DELTAS], "total",
                   f"under {FIXED_COST_GOAL_S * 1e3:.0f} ms", *[label for _, label in BESIDE],
                   "the probe ran while the model built"], rows))


def _while_building(rows: list[dict[str, Any]]) -> str:
    """Whether every rank's probe ran while its model was built (``not reported``: an older run)."""
    if not reported(rows, "probe_while_building"):
        return "not reported"
    return "yes" if all(r.get("probe_while_building") for row in rows for r in row["ranks"]) else "no"
