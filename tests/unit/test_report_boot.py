"""benchmarks/report_boot.py's figures from a hand-built ``bench_boot.py`` result: the node shape's
per-layer slope and the whole model's estimate from it, the slice measured beside it, and what the
plugin adds to a rank process."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import report_boot  # noqa: E402
import report_fixed  # noqa: E402

PHASES = ("imports", "plugin", "cuda", "config", "process_group", "loader", "construct", "weights", "post")
#: Node seconds by (shape, form, round): not on one line, so the fit has residuals to get right.
NODE_S = {("node-l1", "auto"): (20.0, 20.4), ("node-l2", "auto"): (23.1, 22.9), ("node-l4", "auto"): (29.5, 29.1),
          ("node-l8", "auto"): (41.0, 41.6), ("node-l1", "megamoe"): (18.0, 18.2),
          ("node-l2", "megamoe"): (19.0, 19.4), ("node-l4", "megamoe"): (21.2, 21.0),
          ("node-l8", "megamoe"): (25.9, 25.1), ("slice-l44", "auto"): (60.5, 61.5),
          ("slice-l44", "megamoe"): (33.0, 34.0)}
#: One rank's phases that differ between the forms, by (form, rank), per round.
LOADER_S = {("auto", 0): (0.006, 0.008), ("auto", 1): (0.005, 0.007), ("megamoe", 0): (0.020, 0.024),
            ("megamoe", 1): (0.018, 0.030)}
#: The engine's config reading: the plugin's hook checks a conversion's manifest there.
CONFIG_S = {("auto", 0): (0.110, 0.114), ("auto", 1): (0.120, 0.118), ("megamoe", 0): (0.113, 0.119),
            ("megamoe", 1): (0.121, 0.125)}
CONSTRUCT_S = {("auto", 0): (0.150, 0.170), ("auto", 1): (0.160, 0.200), ("megamoe", 0): (0.160, 0.168),
               ("megamoe", 1): (0.175, 0.205)}
FIXED = {0: {"plugin_import_s": (0.010, 0.012), "plugin_register_s": (0.001, 0.001),
             "install_import_s": (0.030, 0.034), "probe_s": (0.040, 0.050)},
         1: {"plugin_import_s": (0.011, 0.011), "plugin_register_s": (0.001, 0.002),
             "install_import_s": (0.031, 0.029), "probe_s": (0.045, 0.047)}}
#: How long each rank's load waited for the probe, per round (reported, not in the total).
WAIT_S = {0: (0.004, 0.010), 1: (0.0, 0.002)}


#: Each rank's imports: noisy, and no layer count's doing (rank 1's a little longer).
IMPORTS_S = {("node-l1", 0): 20.0, ("node-l1", 1): 23.5, ("node-l2", 0): 26.0, ("node-l2", 1): 21.0,
             ("node-l4", 0): 22.5, ("node-l4", 1): 24.0, ("node-l8", 0): 21.5, ("node-l8", 1): 27.0,
             ("slice-l44", 0): 25.0, ("slice-l44", 1): 25.0}


def rank(shape: str, form: str, r: int, rnd: int) -> dict:
    phases = dict.fromkeys(PHASES, 0.5)
    imports = IMPORTS_S[shape, rnd] + 0.25 * r
    phases.update(imports=imports, config=CONFIG_S[form, r][rnd], loader=LOADER_S[form, r][rnd],
                  construct=CONSTRUCT_S[form, r][rnd])
    fixed = {k: v[rnd] for k, v in FIXED[r].items()} | {"probe_wait_s": WAIT_S[r][rnd]} if form == "megamoe" else {}
    after = NODE_S[shape, form][rnd] - IMPORTS_S[shape, rnd] - 1.0 - 0.5 * r  # rank 0 the slowest after imports
    return {"rank": r, "phases": phases, "process_s": imports + after, "weights_experts_s": 0.5,
            "weights_rest_s": 0.5, **fixed}


@pytest.fixture
def run() -> dict:
    shapes = sorted({s for s, _ in NODE_S})
    setup = [{"name": s, "layers": int(s.split("-l")[1]), "ep_size": 8 if s.startswith("slice") else 2,
              "source_bytes": 1e9, "rest_bytes": 1e8, "converted_bytes": 1e9} for s in shapes]
    rows = [{"shape": s, "form": f, "cache": "warm", "round": rnd, "node_s": seconds[rnd],
             "ranks": [rank(s, f, r, rnd) for r in (0, 1)]}
            for (s, f), seconds in NODE_S.items() for rnd in (0, 1)]
    return {"machine": {"gpus": [], "cpus": 2, "rank_processes": 2, "torch": "2"}, "setup": setup, "rows": rows,
            "skipped": [], "identical": {}}


def node_median(phase: dict, form: str) -> float:
    """A phase's median over every rank and round of a form: the forms' difference is taken node-wide."""
    return statistics.median(t for (f, _), times in phase.items() if f == form for t in times)


def split_row(row: str) -> list[str]:
    return [c.strip() for c in row.strip("|").split("|")]


def expected_fit(form: str) -> tuple[float, float, float]:
    """numpy's degree-1 polyfit of the slowest rank's time after its imports (medians of the rounds)
    on the layers, and the median of the node time less that, over every node row of the form."""
    xs = [int(s.split("-l")[1]) for (s, f) in NODE_S if f == form and s.startswith("node")]

    def after(shape: str, rnd: int) -> float:
        return max(r["process_s"] - r["phases"]["imports"] for r in (rank(shape, form, i, rnd) for i in (0, 1)))

    ys = [statistics.median(after(f"node-l{x}", rnd) for rnd in (0, 1)) for x in xs]
    slope, intercept = np.polyfit(xs, ys, 1)
    start = statistics.median(NODE_S[f"node-l{x}", form][rnd] - after(f"node-l{x}", rnd) for x in xs for rnd in (0, 1))
    return float(slope), float(intercept), start


@pytest.mark.parametrize("form", ["auto", "megamoe"])
def test_slope_is_the_least_squares_line_of_the_node_shape(run, form):
    fit = report_boot.slope(report_boot.cells(run), form, "warm")
    slope, intercept, start = expected_fit(form)
    assert fit.layers == [1, 2, 4, 8]
    assert fit.per == pytest.approx(slope) and fit.base == pytest.approx(intercept)
    assert fit.start == pytest.approx(start)


def test_whole_model_is_an_estimate_beside_the_measured_slice(run):
    text = report_boot.slopes(run, report_boot.cells(run))
    assert "estimate from measured per-layer slopes" in text
    header = split_row(next(row for row in text.splitlines() if row.startswith("| form |")))
    for form in ("auto", "megamoe"):
        slope, intercept, start = expected_fit(form)
        line = next(row for row in text.splitlines() if row.startswith(f"| `{form}` | warm |"))
        cells = dict(zip(header, split_row(line), strict=True))
        assert cells["s per MoE layer"] == f"{slope:.3f}" and cells["s at 0 layers after imports"] == f"{intercept:.2f}"
        estimate = start + intercept + 44 * slope
        assert cells["44 layers, s (estimate from measured per-layer slopes)"] == f"{estimate:.1f}"
        measured = statistics.median(NODE_S["slice-l44", form])
        assert cells["slice of 44 layers, s (measured)"] == f"{measured:.1f}"  # measured, not fitted


def test_no_slope_from_fewer_than_three_layer_counts(run):
    run["rows"] = [row for row in run["rows"] if row["shape"] in ("node-l1", "node-l2", "slice-l44")]
    assert report_boot.slope(report_boot.cells(run), "auto", "warm") is None
    assert report_boot.slopes(run, report_boot.cells(run)) == ""


def test_the_plugins_cost_on_a_rank_process_critical_path(run):
    """The total is the plugin's own steps, the load's wait for the probe and the loader's making over
    ``auto``'s (node-wide); the config reading over ``auto``'s (node-wide), the probe's own time and the
    model build over ``auto``'s stand beside it, not in it."""
    costs = {c["rank"]: c for c in report_fixed.fixed_costs(report_boot.cells(run), "node-l4", "warm")}
    for r in (0, 1):
        own = sum(statistics.median(v) for k, v in FIXED[r].items() if k != "probe_s")
        waited = statistics.median(WAIT_S[r])
        loader = node_median(LOADER_S, "megamoe") - node_median(LOADER_S, "auto")
        config = node_median(CONFIG_S, "megamoe") - node_median(CONFIG_S, "auto")
        construct = statistics.median(CONSTRUCT_S["megamoe", r]) - statistics.median(CONSTRUCT_S["auto", r])
        assert costs[r]["config"] == pytest.approx(config) and config > 0
        assert costs[r]["total"] == pytest.approx(own + waited + loader)
        assert costs[r]["construct"] == pytest.approx(construct)
        assert costs[r]["probe_s"] == pytest.approx(statistics.median(FIXED[r]["probe_s"]))
    text = report_boot.section_of("boot-test", run)
    worst = max(costs.values(), key=lambda c: c["total"])
    lines = text.splitlines()
    line = next(row for row in lines if row.startswith("| node-l4 | warm |"))
    header = next(row for row in lines if row.startswith("| shape | cache | rank"))
    cells = dict(zip(split_row(header), split_row(line), strict=True))
    assert cells["rank"] == str(worst["rank"]) and cells["total"] == f"{1e3 * worst['total']:.1f}"
    assert cells["under 50 ms"] == ("yes" if worst["total"] < 0.050 else "no")
    assert cells["the load's wait for the probe"] == f"{1e3 * statistics.median(WAIT_S[worst['rank']]):.1f}"
    assert cells["model build, over auto"] == f"{1e3 * worst['construct']:.1f}"
    assert cells["engine config, over auto"] == f"{1e3 * worst['config']:.1f}"


def test_a_run_that_did_not_time_the_wait_counts_the_probe_whole(run):
    for row in run["rows"]:
        for r in row["ranks"]:
            r.pop("probe_wait_s", None)
    costs = {c["rank"]: c for c in report_fixed.fixed_costs(report_boot.cells(run), "node-l4", "warm")}
    for r in (0, 1):
        assert costs[r]["probe_wait_s"] == pytest.approx(statistics.median(FIXED[r]["probe_s"]))


def test_the_engines_own_plugin_loading_timed_under_auto_is_not_the_plugins_cost(run):
    """SGLang runs its load_plugins in every process: where ``auto`` timed it, ``register`` is less it."""
    own = {0: 0.0006, 1: 0.0004}
    for row in run["rows"]:
        if row["form"] == "auto":
            for r in row["ranks"]:
                r["engine_plugins_s"] = own[r["rank"]]
    costs = {c["rank"]: c for c in report_fixed.fixed_costs(report_boot.cells(run), "node-l4", "warm")}
    for r in (0, 1):
        register = statistics.median(FIXED[r]["plugin_register_s"])
        assert costs[r]["plugin_register_s"] == pytest.approx(register - own[r])


def test_a_node_of_more_rank_processes_than_gpus_is_a_node_kind_of_its_own(run):
    four = {**run, "machine": {**run["machine"], "gpus": ["NVIDIA H100 80GB HBM3"] * 4, "rank_processes": 4}}
    eight = {**four, "machine": {**four["machine"], "rank_processes": 8}}
    assert report_boot.node_kind(four) == f"4 x H100, {four['machine']['cpus']} CPUs"
    assert report_boot.node_kind(eight) == f"8 rank processes on 4 x H100, {four['machine']['cpus']} CPUs"
    assert len(report_boot.pooled([("boot-4", four), ("boot-8", eight)], "warm")) == 2


def test_the_whole_model_estimate_pools_a_node_kinds_runs(run):
    """Two runs on one node kind, each with a part of the node shape's layer counts, give the slope of
    all of them together; cold starts with two layer counts only are fitted and say so."""
    first, second = dict(run), dict(run)
    first["rows"] = [r for r in run["rows"] if r["shape"] in ("node-l1", "node-l2")]
    second["rows"] = [r for r in run["rows"] if r["shape"] in ("node-l4", "node-l8")]
    second["rows"] += [dict(r, cache="cold") for r in second["rows"]]
    text = report_boot.whole_model([("boot-a", first), ("boot-b", second)])
    assert "not a measurement" in text
    lines = text.splitlines()
    header = split_row(next(row for row in lines if row.startswith("| node |")))
    warm = dict(zip(header, split_row(next(row for row in lines if "| warm |" in row)), strict=True))
    cold = dict(zip(header, split_row(next(row for row in lines if "| cold |" in row)), strict=True))
    assert warm["MoE layers measured"] == "1, 2, 4, 8" and warm["runs"] == "`boot-a`, `boot-b`"
    estimate = {}
    for form in ("auto", "megamoe"):
        slope, intercept, start = expected_fit(form)
        estimate[form] = start + intercept + 44 * slope
    assert warm["`megamoe` s (estimate)"] == f"{estimate['megamoe']:.1f}"
    assert warm["`auto` s (estimate)"] == f"{estimate['auto']:.1f}"
    assert cold["MoE layers measured"] == "4, 8 (fewer than 3)" and cold["runs"] == "`boot-b`"
    other = dict(second, machine=dict(second["machine"], cpus=64))  # another node kind: not pooled
    apart = report_boot.whole_model([("boot-a", first), ("boot-c", other)])
    assert "| CPU, 2 CPUs | warm | 1, 2 (fewer than 3) |" in apart and "| CPU, 64 CPUs | warm | 4, 8 (fewer" in apart


def test_whole_model_layers_are_bench_boots_slice_default():
    import bench_boot

    assert bench_boot.parse_args([]).slice_layers == report_boot.WHOLE_MODEL_LAYERS


def test_a_field_an_older_run_did_not_report_is_not_timed(run):
    for row in run["rows"]:
        for r in row["ranks"]:
            r.pop("install_import_s", None)
            r.pop("probe_wait_s", None)
    lines = report_boot.section_of("boot-test", run).splitlines()
    header = split_row(next(row for row in lines if row.startswith("| shape | cache | rank")))
    cells = dict(zip(header, split_row(next(row for row in lines if row.startswith("| node-l4 | warm |"))),
                     strict=True))
    assert cells["first call's imports"] == "not timed" and cells["the load's wait for the probe"] == "not timed"
    assert cells["the probe's own time, beside the reads"] != "not timed"


def test_the_rests_time_under_each_form_side_by_side(run):
    """Where the megamoe rows say how they read the non-expert weights, each shape's rest under
    ``auto`` and ``megamoe`` stand in one row; a run that did not say has no such table."""
    assert "The non-expert weights" not in report_boot.section_of("boot-test", run)
    for row in run["rows"]:
        for r in row["ranks"]:
            r["weights_rest_s"] = {"auto": 4.0, "megamoe": 1.6}[row["form"]] - 0.5 * r["rank"]
            r["rest_staged"] = row["form"] == "megamoe"
            r["rest_fingerprint"] = "same"
    lines = report_boot.section_of("boot-test", run).splitlines()
    header = split_row(next(row for row in lines if row.startswith("| shape | cache | `auto` s")))
    cells = dict(zip(header, split_row(next(row for row in lines if row.startswith("| slice-l44 | warm | 4.00"))),
                     strict=True))
    assert cells["`megamoe` s"] == "1.60" and cells["`auto` s / `megamoe` s"] == "2.50x"  # slowest ranks
    assert cells["`auto`: share of its weight phase"] == "800%"  # 4.0 s of the fixture's 0.5 s weight phase
    assert cells["`megamoe` read them through"] == "megamoe's staging ring"
    assert any(line.startswith("Identical bytes of every parameter across forms") for line in lines)
