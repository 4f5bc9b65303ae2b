"""The weight-cache daemon section of docs/benchmarks.md (from benchmarks/results/daemon-h100/*.json,
saved by benchmarks/bench_daemon.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
FOLDER = RESULTS / "daemon-h100"
COMMAND = ("`benchmarks/device_startup.sh setup && benchmarks/device_startup.sh daemon` (each run: "
           "`PYTHONPATH=/path/to/vllm-0.33 python3 benchmarks/bench_daemon.py [--cold] --save "
           "benchmarks/results/daemon-h100/warm.json`)")


def _row(name: str, what: str, best: dict[str, float], total: str, part: str) -> list[str]:
    return [name, what, f"{best[total]:.2f}", f"{best.get(part, float('nan')):.3f}", f"{best['import_s']:.2f}"]


def best_of(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """role -> each of its timed fields' best over the repeats."""
    best: dict[str, dict[str, float]] = {}
    for run in result["runs"]:
        for key, report in run.items():
            if isinstance(report, dict):
                name = f"daemon_{report['from']}" if key == "daemon" else key
                for field, value in report.items():
                    if field.endswith("_s"):
                        best.setdefault(name, {})[field] = min(value, best.get(name, {}).get(field, 1e9))
    return best


def summary() -> list[str]:
    """The daemon row of the page's table of other figures (the cold run)."""
    path = FOLDER / "cold.json"
    result = json.loads(path.read_text())
    best, setup = best_of(result), result["setup"]
    return ["a weight-cache daemon's load, one rank alone, cold", f"{best['daemon_prebaked']['load_s']:.2f} s from the "
            f"pre-baked shards; an engine restart maps them in {best['engine']['map_s'] * 1e3:.0f} ms",
            f"vLLM's own `vllm preload` from the source: {best['daemon_source']['load_s']:.2f} s",
            f"1 x H100; rank {result['rank']} of EP {result['ep_size']}, {setup['rank_bytes'] / 1e9:.2f} GB",
            "[daemon](#vllm-033s-weight-cache-daemon-cold-start-and-engine-restart)"]


def section() -> str:
    head = """## vLLM 0.33's weight-cache daemon: cold start and engine restart

`benchmarks/bench_daemon.py` times, each in a fresh process on the GPU with vLLM 0.33's own
`weight_cache` code (`WeightCacheDaemon.get_model` / `serve_forever`, `IpcModelLoader`): a daemon's
cold start from the pre-baked shards (`megamoe preload`) and from the source with vLLM's own path
(`vllm preload --model SRC`), an engine restart through `--load-format ipc_cache` (CUDA IPC), and
`install()`'s first call. Every role ends with a checksum of what the kernel reads; all are equal.
`--smoke` runs it tiny on the CPU (`tests/engines/test_vllm_weight_cache.py::test_bench_daemon_smoke`).
"""
    files = sorted(FOLDER.glob("*.json"))
    if not files:
        return head + f"""
Not measured yet: run {COMMAND} on a GPU machine, then `python benchmarks/make_report.py`.
"""
    parts = [head]
    for path in files:
        result: dict[str, Any] = json.loads(path.read_text())
        best = best_of(result)
        setup = result["setup"]
        rows = [_row("daemon, pre-baked shards", "megamoe preload", best["daemon_prebaked"], "ready_s", "load_s"),
                _row("daemon, source", "vllm preload (vLLM's own loading)", best["daemon_source"], "ready_s", "load_s"),
                _row("engine restart", "--load-format ipc_cache", best["engine"], "process_s", "map_s"),
                _row("install() first call", "--load-format megamoe's install", best["install"], "process_s",
                     "load_s")]
        table = ["| role | what | process start -> ready (s) | load / map (s) | imports (s) |",
                 "|---|---|---:|---:|---:|"] + ["| " + " | ".join(r) + " |" for r in rows]
        parts.append(f"""
### {FOLDER.name}/{path.name} (rank {result['rank']} of EP {result['ep_size']}, {setup['rank_bytes'] / 1e9:.2f} GB for the rank, \
{setup['source_bytes'] / 1e9:.2f} GB source, {'cold' if result['cold'] else 'warm'} page cache; best of the repeats)

""" + "\n".join(table) + f"\n\nIdentical kernel views: {result['identical']}. The daemon loads the rank from "
                     f"the pre-baked shards {best['daemon_source']['load_s'] / best['daemon_prebaked']['load_s']:.1f}x "
                     f"faster than vLLM's own path from the source ({best['daemon_prebaked']['load_s']:.2f} s vs "
                     f"{best['daemon_source']['load_s']:.2f} s); an engine restart maps the held weights in "
                     f"{best['engine']['map_s'] * 1e3:.0f} ms, reading nothing from disk.\n")
    return "".join(parts)
