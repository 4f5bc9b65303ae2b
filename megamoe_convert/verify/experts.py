"""``verify --source``: expert slots re-derived from the source checkpoint and compared byte for byte."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Sequence

import torch

from megamoe_convert.convert.gather import ExpertReader
from megamoe_convert.errors import MegamoeError, SourceError
from megamoe_convert.layout import sm90, transform
from megamoe_convert.layout.transform import KernelWeights
from megamoe_convert.output.manifest import Manifest
from megamoe_convert.progress import Progress
from megamoe_convert.serve.loader import load_rank
from megamoe_convert.source.checkpoint import Checkpoint
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import FileCache
from megamoe_convert.verify.report import VerifyReport

# --------------------------------------------------------------------------------------
# 2. against the source
# --------------------------------------------------------------------------------------

def expected_rank_layer(ckpt: Checkpoint, files: FileCache, layer: MoELayer, logical_ids: Sequence[int],
                        device: str = "cpu") -> tuple[KernelWeights, KernelWeights]:
    """The layout of these experts computed directly from the source, as finalize_weights would
    (scales ``None`` for an unscaled format)."""
    reader = ExpertReader(ckpt, files, device)
    scaled = ckpt.dims.format.scaled
    if ckpt.dims.format.kernel == "sm90":  # SGLang's FP8 layout: only the L1 weight's rows move
        return sm90.sm90_transform_experts(reader.stacked(layer, logical_ids, ("w1", "w3"), "weight"),
                                                  reader.fp32_scales(layer, logical_ids, ("w1", "w3")),
                                                  reader.stacked(layer, logical_ids, ("w2",), "weight"),
                                                  reader.fp32_scales(layer, logical_ids, ("w2",)))
    if ckpt.dims.weight_format == "mxfp4":  # the whole transform, with its checks
        return transform.transform_experts(reader.stacked(layer, logical_ids, ("w1", "w3"), "weight"),
                                        reader.stacked(layer, logical_ids, ("w1", "w3"), "scale"),
                                        reader.stacked(layer, logical_ids, ("w2",), "weight"),
                                        reader.stacked(layer, logical_ids, ("w2",), "scale"))
    l1_sf = transform.l1_sf(reader.stacked(layer, logical_ids, ("w1", "w3"), "scale")) if scaled else None
    return (KernelWeights(transform.l1_weight(reader.stacked(layer, logical_ids, ("w1", "w3"), "weight")), l1_sf),
            KernelWeights(transform.l2_weight(reader.stacked(layer, logical_ids, ("w2",), "weight")),
                          transform.l2_sf(reader.stacked(layer, logical_ids, ("w2",), "scale")) if scaled else None))


def sample_slots(manifest: Manifest, ranks: Sequence[int], sample: int | None,
                 rng: random.Random) -> dict[tuple[int, MoELayer], list[int]]:
    """``(rank, layer) -> local slots`` to compare: all of them, or ``sample`` picked at random."""
    every = [(r, layer, s) for r in ranks for layer in manifest.layers
             for s in range(manifest.placement_for(layer).experts_per_rank)]
    chosen = every if sample is None or sample >= len(every) else rng.sample(every, sample)
    slots: dict[tuple[int, MoELayer], list[int]] = {}
    for r, layer, s in sorted(chosen, key=lambda x: (x[1], x[0], x[2])):
        slots.setdefault((r, layer), []).append(s)
    return slots


def load_layer(out: Path, rank: int, layer: MoELayer, report: VerifyReport) -> Any:
    """One rank's layer, or None (with the reason recorded) when it cannot be loaded."""
    try:
        return load_rank(out, rank, layers=[layer.key])[layer.prefix]
    except MegamoeError as e:
        report.problem(f"rank {rank} {layer.key}", f"cannot be loaded: {e}")
        return None


def compare_experts(out: Path, manifest: Manifest, ckpt: Checkpoint, files: FileCache, report: VerifyReport,
                    slots: dict[tuple[int, MoELayer], list[int]], progress: Progress) -> None:
    names = ("l1.weight", "l1.sf", "l2.weight", "l2.sf")
    try:  # a NaN or infinite FP8 block scale compares equal to its copy, yet no kernel runs it
        ckpt.check_block_scales(files, list(dict.fromkeys(layer for _, layer in slots)))
    except SourceError as e:
        report.problem("source", str(e))
    for (rank, layer), local in slots.items():
        progress.advance(len(local) * manifest.dims.bytes_per_expert(), f"experts: rank {rank} {layer.key}", False)
        loaded = load_layer(out, rank, layer, report)
        if loaded is None:
            continue
        ids = [manifest.placement_for(layer).rank_logical_ids(rank)[s] for s in local]
        want = expected_rank_layer(ckpt, files, layer, ids)
        got = (*loaded.l1, *loaded.l2)
        for i, slot in enumerate(local):
            for name, g, w in zip(names, got, (*want[0], *want[1]), strict=True):
                if g is None:  # an unscaled format's scales
                    continue
                assert w is not None  # the source's layout holds every tensor the rank file does
                if not torch.equal(g[slot].reshape(-1).view(torch.uint8), w[i].reshape(-1).view(torch.uint8)):
                    report.problem(f"rank {rank} {layer.key} slot {slot}",
                                   f"{name} differs from logical expert {ids[i]} of the source")
        report.count("expert slots vs source", len(local))
