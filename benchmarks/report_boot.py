"""docs/benchmarks.md's section for ``bench_boot.py``: a whole node's start, process start to a
loaded model, ``--load-format megamoe`` against vLLM 0.33's ``auto``, phase by phase."""

from __future__ import annotations

import statistics
from typing import Any

from common import RESULTS, result, short_gpu, table

#: The phases a rank times, in order, and what each is.
PHASES = (("imports", "Python + vLLM imports"), ("plugin", "megamoe plugin import + register"),
          ("cuda", "CUDA context"), ("config", "engine config"), ("process_group", "process groups"),
          ("loader", "loader made"), ("construct", "model built on the GPU"), ("weights", "every weight"),
          ("post", "process_weights_after_loading"))


def runs() -> list[tuple[str, dict[str, Any]]]:
    """Every saved run, ``results/boot-*/boot.json``, by folder name."""
    return [(p.parent.name, result(f"{p.parent.name}/boot.json")) for p in sorted(RESULTS.glob("boot-*/boot.json"))]


def cells(run: dict[str, Any]) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """(shape, form, cache) -> the rows that ran (every round)."""
    out: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in run["rows"]:
        if "node_s" in row:
            out.setdefault((row["shape"], row["form"], row["cache"]), []).append(row)
    return out


def slowest(rows: list[dict[str, Any]], key: str) -> float:
    """The median over rounds of the slowest rank's ``key`` (a phase, or a report field)."""
    return statistics.median(max(r["phases"][key] if key in r["phases"] else r.get(key, 0.0) for r in row["ranks"])
                             for row in rows)


def node_s(rows: list[dict[str, Any]]) -> float:
    return statistics.median(row["node_s"] for row in rows)


def shape_table(got: dict, shape: str) -> str:
    """One shape: each form and cache's node time, its slowest rank's phases, the weight phase's split."""
    header = ["form", "cache", "rounds", "node s", *[label for _, label in PHASES], "experts s", "the rest s",
              "the rest's share of the weights"]
    rows = []
    for (s, form, cache), got_rows in sorted(got.items()):
        if s != shape:
            continue
        weights = slowest(got_rows, "weights")
        rest = slowest(got_rows, "weights_rest_s")
        rows.append([f"`{form}`", cache, len(got_rows), f"{node_s(got_rows):.2f}",
                     *[f"{slowest(got_rows, key):.3f}" for key, _ in PHASES],
                     f"{slowest(got_rows, 'weights_experts_s'):.2f}", f"{rest:.2f}",
                     f"{rest / weights:.0%}" if weights else ""])
    return table(header, rows)


def slope(got: dict, form: str, cache: str) -> tuple[float, float, list[int]] | None:
    """Least squares of the node shape's node time on its MoE layers: (s per layer, intercept, layers)."""
    points = [(int(s.split("-l")[1]), node_s(rows)) for (s, f, c), rows in got.items()
              if s.startswith("node-") and f == form and c == cache]
    if len(points) < 3:
        return None
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    per = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return per, my - per * mx, sorted(xs)


def slopes(got: dict) -> str:
    rows = []
    for form in ("auto", "megamoe"):
        for cache in ("cold", "warm"):
            fit = slope(got, form, cache)
            if fit:
                per, base, xs = fit
                rows.append([f"`{form}`", cache, ", ".join(map(str, xs)), f"{per:.3f}", f"{base:.2f}",
                             f"{base + 44 * per:.1f} (estimate)"])
    if not rows:
        return ""
    return ("The node shape's time against its MoE layers (least squares; the 44-layer figure is an "
            "extrapolation, not a measurement):\n\n" +
            table(["form", "cache", "layers measured", "s per MoE layer", "s at 0 layers", "44 layers, s"], rows))


def last_error_line(text: str) -> str:
    """A failed row's error: the last line of its rank's output, as it ended."""
    return text.strip().splitlines()[-1].strip().replace("`", "'") if text.strip() else "no output"


def section_of(name: str, run: dict[str, Any]) -> str:
    m = run["machine"]
    got = cells(run)
    gpus = f"{len(m['gpus'])} x {short_gpu(m['gpus'][0])}" if m["gpus"] else "CPU"
    parts = [f"### {name}: {gpus}, {m['cpus']} CPUs, {m['rank_processes']} rank processes, torch {m['torch']}"]
    for info in run["setup"]:
        shape = info["name"]
        what = (f"one node of EP {info['ep_size']}: ranks 0-{m['rank_processes'] - 1}" if shape.startswith("slice")
                else f"one node holds every rank (EP {info['ep_size']})")
        parts.append(f"#### {what}, {info['layers']} MoE layers; source {info['source_bytes'] / 1e9:.1f} GB "
                     f"(non-expert {info['rest_bytes'] / 1e9:.2f} GB), conversion {info['converted_bytes'] / 1e9:.1f} GB")
        parts.append(shape_table(got, shape))
        failed = [f"`{r['form']}` {r['cache']}: {last_error_line(r['failed'])}" for r in run["rows"]
                  if r["shape"] == shape and "failed" in r]
        parts += [f"Did not finish: {'; '.join(failed)}."] if failed else []
    parts += [slopes(got)] if slopes(got) else []
    if run.get("skipped"):
        parts.append("Not run (the run's time budget): " + "; ".join(run["skipped"]) + ".")
    parts.append("Identical kernel bytes across forms: " + ", ".join(f"{k}: {v}" for k, v in run["identical"].items()))
    return "\n\n".join(parts)


def section() -> str:
    """The section, or nothing while no run is saved."""
    found = runs()
    if not found:
        return ""
    intro = ("## A whole node's start: process start to a loaded model (bench_boot.py)\n\n"
             "`benchmarks/bench_boot.py` starts one process per GPU at once; each imports vLLM 0.33, makes "
             "the config `vllm serve` makes, vLLM's process groups (a world of one process, its EP rank set), the "
             "load format's loader, builds vLLM's real `DeepseekV4ForCausalLM` on its GPU, loads every weight "
             "through the loader and runs `process_weights_after_loading`. Node time: from the first spawn to "
             "the last rank's end; phases: the slowest rank's, medians over rounds. The non-expert weights are "
             "BF16 (the checkpoint has no `quantization_config`: vLLM 0.33's FP8 configs need packages the GPU "
             "machine lacks), about twice the bytes of a real FP8 checkpoint's linears. Not timed (they need an "
             "SM100 GPU): the MegaMoE kernels' JIT and buffers, KV-cache sizing, CUDA graphs.")
    return intro + "\n\n" + "\n\n".join(section_of(name, run) for name, run in found) + "\n"
