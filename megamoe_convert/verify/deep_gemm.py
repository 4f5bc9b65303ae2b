"""``verify --deep-gemm``: DeepGEMM's own transform (SM100 only) compared with the rank files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from megamoe_convert.convert.gather import ExpertReader
from megamoe_convert.layout import scales
from megamoe_convert.output.manifest import Manifest
from megamoe_convert.progress import Progress
from megamoe_convert.source.checkpoint import Checkpoint
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import FileCache
from megamoe_convert.verify.experts import load_layer
from megamoe_convert.verify.report import VerifyReport

# --------------------------------------------------------------------------------------
# 4. DeepGEMM cross-check
# --------------------------------------------------------------------------------------

#: DeepGEMM's layout functions run on the GPU (tests point this at the CPU with a stand-in).
DEEP_GEMM_DEVICE = "cuda"


def deep_gemm_unavailable_reason() -> str | None:
    if importlib.util.find_spec("deep_gemm") is None:
        return "deep_gemm is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if major != 10:
        return f"DeepGEMM's MegaMoE layout functions need an SM100 GPU; this GPU is SM{major}{minor}"
    return None


def deep_gemm_layout(w13: torch.Tensor, w13_sf: torch.Tensor, w2: torch.Tensor, w2_sf: torch.Tensor):
    """What vLLM's ``finalize_weights`` computes, with DeepGEMM itself (SM100 only)."""
    import deep_gemm

    experts, two_i, half_h = w13.shape
    hidden, inter = half_h * 2, two_i // 2
    sf13 = deep_gemm.transform_sf_into_required_layout(scales.widen_ue8m0_to_fp32(w13_sf), two_i, hidden,
                                                       (1, 32), experts)
    sf2 = deep_gemm.transform_sf_into_required_layout(scales.widen_ue8m0_to_fp32(w2_sf), hidden, inter,
                                                      (1, 32), experts)
    return deep_gemm.transform_weights_for_mega_moe((w13.view(torch.int8), sf13), (w2.view(torch.int8), sf2))


def check_deep_gemm(out: Path, manifest: Manifest, ckpt: Checkpoint, files: FileCache, report: VerifyReport,
                    slots: dict[tuple[int, MoELayer], list[int]], progress: Progress) -> None:
    reason = deep_gemm_unavailable_reason()
    if manifest.dims.weight_format != "mxfp4":
        reason = f"DeepGEMM's fp8_fp4 transform takes MXFP4 only; these are {manifest.dims.weight_format} experts"
    if reason:
        report.skipped["deep_gemm"] = reason
        return
    for (rank, layer) in slots:
        ids = manifest.placement_for(layer).rank_logical_ids(rank)
        progress.advance(len(ids) * manifest.dims.bytes_per_expert(), f"deep_gemm: rank {rank} {layer.key}", False)
        reader = ExpertReader(ckpt, files, DEEP_GEMM_DEVICE)
        theirs = deep_gemm_layout(reader.stacked(layer, ids, ("w1", "w3"), "weight"),
                                  reader.stacked(layer, ids, ("w1", "w3"), "scale"),
                                  reader.stacked(layer, ids, ("w2",), "weight"),
                                  reader.stacked(layer, ids, ("w2",), "scale"))
        ours = load_layer(out, rank, layer, report)
        if ours is None:
            continue
        for name, a, b in zip(("l1.weight", "l1.sf", "l2.weight", "l2.sf"), (*ours.l1, *ours.l2),
                              (*theirs[0], *theirs[1]), strict=True):
            if a.shape != b.shape or a.stride() != b.stride() or not torch.equal(a, b.cpu()):
                report.problem(f"rank {rank} {layer.key}", f"{name} differs from deep_gemm's own transform")
        report.count("layers vs deep_gemm")
