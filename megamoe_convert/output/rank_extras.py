"""Rank-file tensors beyond the routed L1/L2 operands: NVFP4's global scales and the fused shared expert.

Both are small next to a rank's routed experts (a few floats per expert; one expert-sized MLP
per layer), so each is produced whole, in file order, right after the routed tensors
(:func:`formats.rank_tensor_specs` fixes the order).

- NVFP4 (``formats.GLOBAL_SCALE_TENSORS``): per local slot the L1 global scale (w1's, which must
  equal w3's: the kernel takes one L1 scale per expert), the L2 global scale and the L2 input
  scale; and the L2 input scale of every logical expert, whose maximum the kernel quantizes L2
  inputs with (every rank needs all of them, as EPLB may move any expert anywhere).
- The shared expert, laid out like one routed expert of ``formats.SHARED_FORMAT``: w1/w3 rows
  gate/up-interleaved, their 128x128 block scales expanded to 1x32 groups, packed, MN-major,
  interleaved and UTCCP-transposed (``transform.l1_sf``); w2 likewise without the interleave.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator, Sequence

import torch

from megamoe_convert.layout import scales, transform
from megamoe_convert.source import formats
from megamoe_convert.source.checkpoint import Checkpoint, CheckpointError
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import FileCache


def _scalar_bytes(ckpt: Checkpoint, files: FileCache, layer: MoELayer, expert: int, proj: str,
                  kind: str) -> torch.Tensor:
    """One NVFP4 global scale's FP32 bytes; a value the kernel cannot scale by (NaN, inf, zero or
    negative) is the source's problem, named as such."""
    raw = files.read(ckpt.expert_entry(layer, expert, proj, kind)).reshape(4)
    value = float(raw.view(torch.float32))
    if not math.isfinite(value) or value <= 0:
        name = ckpt.expert_name(layer, expert, proj, kind)
        raise CheckpointError(f"{ckpt.file_of(name)}: {name} is {value}; NVFP4 global scales must be finite and "
                              "positive (the source checkpoint is damaged)")
    return raw


def check_global_scales(ckpt: Checkpoint, files: FileCache, layers: Sequence[MoELayer]) -> None:
    """Every NVFP4 global scale of ``layers`` finite and positive, before anything is written (a few
    floats per expert: one small read each)."""
    if not ckpt.dims.format.global_scales:
        return
    for layer in layers:
        for expert in range(ckpt.dims.experts_of(layer)):
            for proj, kind in formats.GLOBAL_SCALE_TENSORS:
                _scalar_bytes(ckpt, files, layer, expert, proj, kind)


def global_scale_chunks(ckpt: Checkpoint, files: FileCache, layer: MoELayer, logical_ids: Sequence[int],
                        ) -> Iterator[torch.Tensor]:
    """NVFP4: ``l1_global_scale``, ``l2_global_scale``, ``l2_input_scale`` (per slot, FP32 bytes),
    then ``l2_input_scale_all`` (per logical expert)."""
    l1 = []
    for expert in logical_ids:
        w1, w3 = (_scalar_bytes(ckpt, files, layer, expert, p, "weight_scale_2") for p in ("w1", "w3"))
        if not torch.equal(w1, w3):
            values = [float(t.view(torch.float32)) for t in (w1, w3)]
            raise CheckpointError(f"{ckpt.file_of(ckpt.expert_name(layer, expert, 'w3', 'weight_scale_2'))}: "
                                  f"{ckpt.expert_name(layer, expert, 'w3', 'weight_scale_2')} is {values[1]} "
                                  f"but w1's is {values[0]}; the MegaMoE kernel takes one L1 scale per expert")
        l1.append(w1)
    yield torch.cat(l1)
    yield torch.cat([_scalar_bytes(ckpt, files, layer, e, "w2", "weight_scale_2") for e in logical_ids])
    yield torch.cat([_scalar_bytes(ckpt, files, layer, e, "w2", "input_scale") for e in logical_ids])
    yield torch.cat([_scalar_bytes(ckpt, files, layer, e, "w2", "input_scale")
                     for e in range(ckpt.dims.experts_of(layer))])


def extra_chunks(ckpt: Checkpoint, files: FileCache, layer: MoELayer, logical_ids: Sequence[int],
                 shared: Iterable[torch.Tensor] | None = None) -> Iterator[torch.Tensor]:
    """Everything of a rank file after its routed L1/L2 operands, in file order
    (:func:`formats.rank_tensor_specs`): the global scales (NVFP4), the logical ids, the shared
    expert (where one is pre-baked; ``shared``: its :func:`shared_expert_chunks`, made once for
    every rank file of the layer). ``convert`` writes these; ``verify --source`` compares them."""
    if ckpt.dims.format.global_scales:
        yield from global_scale_chunks(ckpt, files, layer, logical_ids)
    yield torch.tensor(list(logical_ids), dtype=torch.int32)
    if ckpt.dims.shared_intermediate_size:
        yield from shared_expert_chunks(ckpt, files, layer) if shared is None else shared


def _shared_sf(ckpt: Checkpoint, files: FileCache, layer: MoELayer, proj: str, k: int) -> torch.Tensor:
    """One shared projection's block scales as 1x32 UE8M0 bytes ``[N, K/32]``."""
    weight = ckpt.shared_entry(layer, proj, "weight")
    group = formats.SHARED_FORMAT.scale_group_k
    assert group is not None
    scale = files.read(ckpt.shared_entry(layer, proj, "scale"))
    return scales.expand_block_scales(scale, weight.shape[0], k // group)


def shared_expert_chunks(ckpt: Checkpoint, files: FileCache, layer: MoELayer) -> Iterator[torch.Tensor]:
    """``shared_l1_weight``, ``shared_l1_sf``, ``shared_l2_weight``, ``shared_l2_sf`` (storage form)."""
    h, s = ckpt.dims.hidden_size, ckpt.dims.shared_intermediate_size
    w13 = torch.cat([files.read(ckpt.shared_entry(layer, p, "weight")) for p in ("w1", "w3")]).unsqueeze(0)
    yield transform.l1_weight(w13)
    sf13 = torch.cat([_shared_sf(ckpt, files, layer, p, h) for p in ("w1", "w3")]).unsqueeze(0)
    yield scales.sf_storage(transform.l1_sf(sf13))
    yield transform.l2_weight(files.read(ckpt.shared_entry(layer, "w2", "weight")).unsqueeze(0))
    yield scales.sf_storage(transform.l2_sf(_shared_sf(ckpt, files, layer, "w2", s).unsqueeze(0)))
