#!/usr/bin/env python3
"""vLLM's load formats that need a GPU here, serving a conversion: the proof of the ``NEEDS_GPU`` rows
of ``megamoe_convert/engines/vllm/format_table.py`` that the CPU tests cannot give.

For each such format (fastsafetensors, instanttensor, runai_streamer: their packages read onto the
GPU) and each form of a conversion (per-rank files, a store), the engine's own loader for the
format loads the conversion into its real modules (``tests/engines/vllm_harness.py`` /
``sglang_harness.py``: the MegaMoE SM100 checks and process groups patched, the platform the
iterators ask for a device answering CUDA), exactly as ``tests/engines/test_*_format_matrix.py``
proves the CPU formats (their ``serves``): the experts must be byte-equal to the engine's own
loading of the source. One line per format and form; exit 1 on any
difference, 2 where a format cannot run (no GPU, its package missing). ``--smoke`` runs the same
path on the CPU with ``safetensors`` (what CI runs).

    PYTHONPATH=/tmp/site:/tmp/v33:. VLLM_TARGET_DEVICE=cpu MEGAMOE_ENGINE=vllm==0.33.0 \\
        python3 benchmarks/gpu_load_formats.py --work /tmp/gpu-formats
    PYTHONPATH=/tmp/site:/tmp/sglang:. MEGAMOE_ENGINE=sglang==0.5.23 \\
        python3 benchmarks/gpu_load_formats.py --engine sglang --work /tmp/gpu-formats-sglang
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: The Python package each format's iterator imports.
PACKAGES = {"fastsafetensors": "fastsafetensors", "instanttensor": "instanttensor",
            "runai_streamer": "runai_model_streamer"}


def gpu_formats(engine: str = "vllm") -> list[str]:
    """The engine's table's ``NEEDS_GPU`` formats a loader reads from disk (the daemon's ``ipc_cache``
    is ``bench_daemon.py``'s)."""
    import importlib

    from megamoe_convert.engines.format_matrix import Loads

    table = importlib.import_module(f"megamoe_convert.engines.{engine}.format_table").FORMATS
    return [name for name, row in table.items() if row.kind is Loads.NEEDS_GPU and name in PACKAGES]


def build(work: Path, engine: str) -> tuple[Path, Path, Path]:
    """The engine tests' checkpoint (vLLM: the tiny preset with I = 512; SGLang: its harness's, H = 512),
    its EP 4 conversion with 4 redundant experts, and its store; reused where already built."""
    from megamoe_convert.convert.plan import ConvertOptions
    from megamoe_convert.convert.run import convert
    from megamoe_convert.synth.presets import load_preset
    from megamoe_convert.synth.write import synthesize

    ckpt, per_rank, store = work / "ckpt", work / "ep4", work / "store"
    if not (ckpt / "config.json").exists():
        work.mkdir(parents=True, exist_ok=True)
        if engine == "sglang":
            import sglang_harness

            preset = sglang_harness.CONFIG
        else:
            preset = {**load_preset("tiny"), "moe_intermediate_size": 512}
        (work / "preset.json").write_text(json.dumps(preset))
        synthesize(ckpt, str(work / "preset.json"), seed=5)
    convert(ckpt, per_rank, ConvertOptions(ep_size=4, num_redundant_experts=4, fsync=False,
                                           engine="sglang" if engine == "sglang" else None))
    convert(ckpt, store, ConvertOptions(ep_size=None, fsync=False))
    return ckpt, per_rank, store


@contextlib.contextmanager
def _sglang_cuda_platform():
    """SGLang imported as on the CPU settles on its CPU platform; the iterators that read onto the GPU
    (InstantTensor's) ask it for the device type and the GPU."""
    from unittest import mock

    import sglang.srt.model_loader.weight_utils as weight_utils
    import torch

    real = weight_utils.current_platform

    class Cuda:
        device_type = "cuda"

        def __getattr__(self, name: str):
            return getattr(real, name)

        def get_device(self, index: int):
            return torch.device("cuda", index)

    with mock.patch.object(weight_utils, "current_platform", Cuda()):
        yield


def cannot_run(load_format: str, smoke: bool) -> str | None:
    import torch

    if smoke:
        return None
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    package = PACKAGES[load_format]
    return f"{package} is not installed" if importlib.util.find_spec(package) is None else None


def run(work: Path, formats: list[str], smoke: bool, engine: str = "vllm") -> int:
    sys.path[:0] = [str(REPO / "tests" / "engines"), str(REPO / "benchmarks")]
    import importlib

    import torch

    if engine == "sglang" and torch.cuda.is_available():  # SGLang imported as on the CPU: no sgl_kernel
        importlib.import_module("node_forms_sglang").import_sglang()
    matrix = importlib.import_module(f"test_{engine}_format_matrix")
    h = importlib.import_module(f"{engine}_harness")
    reference = importlib.import_module(f"test_{engine}_model_classes").reference
    ckpt, per_rank, store = build(work, engine)
    topology = (matrix.RANK, matrix.EP_SIZE) + ((matrix.REDUNDANT,) if engine == "sglang" else ())
    with h.patched(*topology):
        want = reference(ckpt, matrix.RANK)
    gpu = torch.cuda.is_available()
    if engine == "vllm" and gpu:
        from node_forms import _cuda_platform as platform  # vLLM's iterators ask its platform for the GPU
    elif engine == "sglang" and gpu:
        platform = _sglang_cuda_platform
    else:
        platform = contextlib.nullcontext
    if engine == "sglang":  # through each loader's own load_model, onto the device it loads to
        def serves(load_format, out, ckpt, want):
            matrix.serves_through_load_model(load_format, out, ckpt, want, "cuda" if gpu else "cpu")
    else:
        serves = matrix.serves
    status = 0
    for load_format in formats:
        why = cannot_run(load_format, smoke)
        for form, out in (("per-rank", per_rank), ("store", store)):
            if why is not None:
                print(f"{load_format} {form}: NOT RUN: {why}")
                status = max(status, 2)
                continue
            try:
                with platform():
                    serves(load_format, out, ckpt, want)
            except Exception as e:  # every format and form is tried; each failure is one line
                print(f"{load_format} {form}: FAILED: {type(e).__name__}: {' '.join(str(e).split())[:400]}")
                status = max(status, 1)
            else:
                print(f"{load_format} {form}: served, experts byte-equal to {engine}'s own loading of the source")
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu-formats"), help="checkpoint and conversions (reused)")
    p.add_argument("--formats", help="comma-separated (default: every NEEDS_GPU format a loader reads from disk)")
    p.add_argument("--engine", choices=("vllm", "sglang"), default="vllm",
                   help="whose loaders and modules (MEGAMOE_ENGINE names the release, as tests/engines wants)")
    p.add_argument("--smoke", action="store_true", help="the same path on the CPU with safetensors (CI)")
    args = p.parse_args(argv)
    formats = ["safetensors"] if args.smoke else (args.formats.split(",") if args.formats
                                                  else gpu_formats(args.engine))
    return run(args.work, formats, args.smoke, args.engine)


if __name__ == "__main__":
    raise SystemExit(main())
