"""What the benchmarks share: synthesised checkpoints, a conversion, the page cache, the result line.

Nothing here imports torch or an engine when imported, so a script may time its own imports after
importing this module. The scripts import it as ``common`` (``benchmarks/`` is on their path).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def node_machine(rank_processes: int, omp_threads: int, gpus: int | None = None) -> dict[str, Any]:
    """The machine a node's run measured: its GPUs (the first ``gpus``; default every one), CPUs, torch
    and Python, and the rank processes it started with their OpenMP threads each."""
    import torch

    count = torch.cuda.device_count() if gpus is None else gpus
    return {"gpus": [torch.cuda.get_device_name(i) for i in range(count)], "cpus": os.cpu_count(),
            "torch": torch.__version__, "python": sys.version.split()[0], "rank_processes": rank_processes,
            "omp_threads": omp_threads}


# --------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------

def bench_config(preset: str, layers: int, experts: int, mtp: int, vocab: int) -> dict:
    """A preset's config (real expert dims) cut to ``layers`` decoder layers of ``experts`` experts."""
    from megamoe_convert.synth.presets import load_preset

    config = dict(load_preset(preset))
    config.update(num_hidden_layers=layers, n_routed_experts=experts, num_nextn_predict_layers=mtp,
                  num_hash_layers=min(config.get("num_hash_layers", 0), layers),
                  num_experts_per_tok=min(config["num_experts_per_tok"], experts), vocab_size=vocab)
    return config


def fast_tensor_bytes(t: Any, rng: Any) -> Any:
    """Stands in for ``synth._tensor_bytes`` in benchmarks: the same kinds of bytes, drawn from
    SFC64 raw words (``Generator.bytes`` makes ~0.2-0.3 GB/s; this, a few GB/s)."""
    import numpy as np

    from megamoe_convert import synth

    if t.fill == "ones":
        return np.full(t.nbytes // 2, 0x3F80, dtype=np.uint16).tobytes()
    seed = int(rng.integers(2**62))
    raw = np.random.Generator(np.random.SFC64(seed)).bit_generator.random_raw(-(-t.nbytes // 8)).view(np.uint8)
    raw = raw[:t.nbytes]
    if t.fill == "scale":
        lo, hi = synth.SCALE_BYTE_RANGE
        raw = (raw % (hi - lo) + lo).astype(np.uint8)
    return memoryview(raw)


def ensure_checkpoint(path: Path, config: dict) -> float:
    """Synthesise ``config`` into ``path`` unless an identical one is there; return seconds spent."""
    from megamoe_convert import synth

    marker = path / ".bench-config.json"
    if marker.exists() and json.loads(marker.read_text()) == config:
        return 0.0
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    config_file = path.parent / f"{path.name}.config.json"
    config_file.write_text(json.dumps(config))
    synth._tensor_bytes = fast_tensor_bytes  # random bytes fast (this process only synthesises)
    start = time.perf_counter()
    synth.synthesize(path, str(config_file))
    seconds = time.perf_counter() - start
    marker.write_text(json.dumps(config))
    return seconds


def synth_checkpoint(path: str, config: dict) -> float:
    """:func:`ensure_checkpoint` with a string path, picklable for a process pool."""
    return ensure_checkpoint(Path(path), config)


def run_convert(src: Path, out: Path, ep_size: int, workers: int, fsync: bool) -> int:
    """What ``megamoe convert --experts-only`` runs; the bytes written."""
    from megamoe_convert.convert.plan import ConvertOptions
    from megamoe_convert.convert.run import convert

    summary = convert(src, out, ConvertOptions(ep_size=ep_size, experts_only=True, workers=workers, fsync=fsync))
    return summary.bytes_written


def repo_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH`` and the rest kept (on a GPU
    machine, the folders of the carried packages), for a child that runs the project's code."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


# --------------------------------------------------------------------------------------
# The page cache and the process's reads
# --------------------------------------------------------------------------------------

def drop_page_cache() -> bool:
    """Sync, then drop the page cache (needs root); whether the drop was allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------

def emit_summary(summary: dict, save: str | Path | None) -> None:
    """Print the summary as the last line (the benchmark's result); also write it to ``save``."""
    if save:
        Path(save).parent.mkdir(parents=True, exist_ok=True)
        Path(save).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))


# --------------------------------------------------------------------------------------
# Reports (make_report.py and report_*.py)
# --------------------------------------------------------------------------------------

RESULTS = REPO / "benchmarks" / "results"
GB = 1e9


def result(name: str) -> dict[str, Any]:
    """A saved result, ``benchmarks/results/NAME``."""
    return json.loads((RESULTS / name).read_text())


def result_text(name: str) -> str:
    return (RESULTS / name).read_text().rstrip()


def gb(n: float) -> str:
    return f"{n / GB:.2f}"


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table, every column right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def short_gpu(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``H100``."""
    return name.replace("NVIDIA ", "").split()[0] if name else "CPU"
