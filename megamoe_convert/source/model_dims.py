"""The sizes that fix a model's MegaMoE layout (:class:`ModelDims`), read from its ``config.json``.

Apart from ``checkpoint`` because more than a checkpoint's reader uses them: the manifest records them and
checks them against the same bounds, the rank files are shaped by them, and ``synth`` bounds its layer counts
with :data:`MAX_LAYERS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megamoe_convert import jsonio
from megamoe_convert.errors import CheckpointError, LayoutError
from megamoe_convert.source import formats
from megamoe_convert.source.families import ModelFamily
from megamoe_convert.source.formats import WeightFormat
from megamoe_convert.source.layers import MoELayer

#: Bounds on config.json's sizes and counts, checked before anything is built from them.
MAX_DIM = 1 << 20
MAX_LAYERS = 1 << 16
#: Physical slots (experts of one layer, redundant ones included) a placement may have.
MAX_PHYSICAL_EXPERTS = 1 << 20
#: H and I must be multiples of this (checked up front, as vLLM/DeepGEMM do).
DIM_MULTIPLE = 128


def check_dims(hidden: int, intermediate: int, where: object = None) -> None:
    """The spec's up-front requirement: ``H % 128 == 0`` and ``I % 128 == 0`` (``where``: the file
    the sizes come from, named in the error)."""
    prefix = "" if where is None else f"{where}: "
    for name, value in (("hidden_size", hidden), ("moe_intermediate_size", intermediate)):
        if value <= 0 or value % DIM_MULTIPLE:
            raise LayoutError(f"{prefix}{name}={value} must be a positive multiple of {DIM_MULTIPLE}")


@dataclass(frozen=True)
class ModelDims:
    """The sizes that fix the MegaMoE layout of every MoE layer."""

    hidden_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    weight_format: str = formats.MXFP4.name  # the routed experts' format (formats.FORMATS)
    #: Intermediate size of the shared expert pre-baked for fusion into the MegaMoE launch; 0: none.
    shared_intermediate_size: int = 0
    #: The MTP layers' own routed expert count (DeepSeek-V4.1's DSpark draft); 0: ``n_routed_experts``.
    mtp_n_routed_experts: int = 0

    def experts_of(self, layer: "MoELayer") -> int:
        """The logical experts ``layer`` has: the MTP layers' own count where they have one."""
        return self.mtp_n_routed_experts if layer.is_mtp and self.mtp_n_routed_experts else self.n_routed_experts

    @property
    def format(self) -> WeightFormat:
        return formats.by_name(self.weight_format)

    def expert_byte_shapes(self) -> dict[tuple[str, str], tuple[int, ...]]:
        """Expected uint8 shape of each ``(projection, kind)`` of one expert."""
        return formats.checkpoint_byte_shapes(self.format, self.hidden_size, self.moe_intermediate_size)

    def bytes_per_expert(self) -> int:
        return sum(math.prod(shape) for shape in self.expert_byte_shapes().values())


def config_int(config: Any, key: str, path: Path, default: int | None = None, hi: int = MAX_DIM,
               name: str | None = None) -> int:
    """An integer field of config.json (``name``: how errors call it, e.g. ``text_config.num_experts``)."""
    f = jsonio.Fields(path, CheckpointError)
    return f.int({key: config.get(key, default)}, key, lo=0, hi=hi, name=f"config field {name or key!r}")


def _mtp_experts(family: ModelFamily, text: Any, path: Path, n_routed: int) -> int:
    """The MTP layers' own expert count (0: the decoder's), as vLLM reads it: the family's key, or
    the decoder's count when it is absent or 0 (``dspark_n_routed_experts or n_routed_experts``)."""
    key = family.keys.get("mtp_experts")
    own = config_int(text, key, path, 0, hi=MAX_PHYSICAL_EXPERTS, name=family.where(key)) if key else 0
    return own if own != n_routed else 0


def dims_from_config(family: ModelFamily, config: dict[str, Any], path: Path) -> ModelDims:
    """The layout's sizes from ``config.json`` (the family says where), each checked before it is used."""
    formats.check_expert_dtype(family.expert_dtype(config), path)
    text, keys = family.text(config, path), family.keys
    if keys["hidden"] != "hidden_size" and keys["hidden"] not in text:  # Kimi-K3's latent width
        raise CheckpointError(f"{path}: no {family.where(keys['hidden'])}: {family.title}'s MegaMoE experts run at "
                              "that hidden size")
    hidden, intermediate, experts = (
        config_int(text, keys[k], path, hi=hi, name=family.where(keys[k]))
        for k, hi in (("hidden", MAX_DIM), ("intermediate", MAX_DIM), ("experts", MAX_PHYSICAL_EXPERTS)))
    dims = ModelDims(hidden, intermediate, experts,
                     mtp_n_routed_experts=_mtp_experts(family, text, path, experts))
    check_dims(dims.hidden_size, dims.moe_intermediate_size, path)
    if dims.n_routed_experts <= 0:
        raise CheckpointError(f"{path}: {family.where(keys['experts'])} must be positive, "
                              f"got {dims.n_routed_experts}")
    return dims
