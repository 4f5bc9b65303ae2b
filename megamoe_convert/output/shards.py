"""What each expert file holds: a rank shard's (or a store file's) tensors in order, its metadata
and its exact size.

This is the one contract between the writer and every reader: ``convert`` writes these tensors
in this order, the loader, the store reader, the engines and ``verify`` read them back by it, and
the manifest's check of each listed size asks :func:`rank_shard_size`.
"""

from __future__ import annotations

from megamoe_convert.layout.placement import Placement
from megamoe_convert.source import formats
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.model_dims import ModelDims
from megamoe_convert.source.safetensors_io import TensorSpec, encode_header

#: Version of the MegaMoE tensor layout (DeepGEMM ``transform_weights_for_mega_moe``).
LAYOUT_VERSION = 1
_SF_STORAGE = "[E, packed_k, MN]; kernel view = tensor.transpose(1, 2)"


def rank_shard_specs(layer: MoELayer, experts: int, dims: ModelDims) -> list[TensorSpec]:
    """The tensors of one rank shard, in file order (the writer's and every reader's contract):
    what :func:`formats.rank_tensor_specs` gives for the conversion's format and shared expert."""
    return formats.rank_tensor_specs(dims.format, layer.prefix, experts, dims.hidden_size,
                                     dims.moe_intermediate_size, dims.experts_of(layer), dims.shared_intermediate_size)


def rank_shard_metadata(layer: MoELayer, rank: int, ep_size: int, dims: ModelDims) -> dict[str, str]:
    """A rank shard's safetensors metadata. ``weight_format`` names the experts' format for every
    format but MXFP4, whose shards carry none (no entry: MXFP4). Readers take the format from the
    manifest's ``dims``; the header's bytes count in the size :func:`rank_shard_size` gives."""
    metadata = {"format": "megamoe", "layout_version": str(LAYOUT_VERSION), "layer": layer.key,
                "rank": str(rank), "ep_size": str(ep_size), "sf_storage": _SF_STORAGE}
    if dims.weight_format != formats.MXFP4.name:
        metadata["weight_format"] = dims.weight_format
    return metadata


def store_metadata(layer: MoELayer, dims: ModelDims) -> dict[str, str]:
    """A store file's safetensors metadata: no rank, no EP size (its experts are every logical one, in order)."""
    return {"format": "megamoe", "layout_version": str(LAYOUT_VERSION), "layer": layer.key, "store": "logical-experts",
            "weight_format": dims.weight_format, "sf_storage": _SF_STORAGE}


def rank_shard_size(layer: MoELayer, rank: int, placement: Placement, dims: ModelDims, store: bool = False) -> int:
    """The exact size of a rank shard (or with ``store``, a store file): its header (aligned) plus its tensors."""
    specs = rank_shard_specs(layer, placement.experts_per_rank, dims)
    metadata = store_metadata(layer, dims) if store else rank_shard_metadata(layer, rank, placement.ep_size, dims)
    return len(encode_header(specs, metadata)) + sum(s.nbytes for s in specs)
