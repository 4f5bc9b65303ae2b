"""A converted directory opened once, and the form its experts are handed out in.

:class:`ConvertedModel` is what every reader passes on (the manifest read and validated once);
:class:`ExpertLayer` is one layer of one rank as the kernel takes it, whichever reader filled it
(a rank's files: :mod:`.loader`; a store's slots: :mod:`.store`), and :data:`Destinations` the
tensors a reader fills, caller-owned ones checked by :func:`check_destinations`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from megamoe_convert import jsonio
from megamoe_convert.errors import LoadError
from megamoe_convert.jsonio import Fields
from megamoe_convert.layout import scales
from megamoe_convert.layout.placement import Placement
from megamoe_convert.layout.transform import KernelWeights
from megamoe_convert.output.manifest import Manifest
from megamoe_convert.source import families, formats
from megamoe_convert.source.families import ModelFamily, TensorNames
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import TensorEntry


@dataclass
class ExpertLayer:
    """One MoE layer of one rank, as the fused kernel takes it."""

    key: str  # "layers.7" / "mtp.0"
    #: Every loaded tensor by its key (:data:`formats.FILE_NAMES`), scales (``*_sf``) in the kernel's
    #: MN-major view: ``l1_weight`` (MXFP4: int8 [E, 2I, H/2]), ``l1_sf`` (int32 [E, 2I, H/128]), ...
    tensors: dict[str, torch.Tensor]
    logical_ids: tuple[int, ...]  # logical expert of each local slot
    experts_start_idx: int  # first physical slot of this rank

    def _operand(self, name: str) -> KernelWeights:
        return KernelWeights(self.tensors[f"{name}_weight"], self.tensors.get(f"{name}_sf"))

    @property
    def l1(self) -> KernelWeights:
        """``(weight, MN-major scales)``; the scales are ``None`` for an unscaled format (BF16)."""
        return self._operand("l1")

    @property
    def l2(self) -> KernelWeights:
        return self._operand("l2")

    @property
    def shared(self) -> tuple[KernelWeights, KernelWeights] | None:
        """The pre-baked fused shared expert's ``(l1, l2)``, if converted and loaded."""
        return (self._operand("shared_l1"), self._operand("shared_l2")) if "shared_l1_weight" in self.tensors else None

    @property
    def num_local_experts(self) -> int:
        return len(self.logical_ids)


@dataclass
class ConvertedModel:
    """A converted directory opened once: its manifest read and validated, passed on from there."""

    path: Path
    manifest: Manifest
    #: Serving from a store: each layer's placement as the engine built it (the install driver's).
    placements: dict[MoELayer, Placement] = field(default_factory=dict)

    def placement_for(self, layer: MoELayer) -> Placement:
        """The placement ``layer`` is served with: the engine's (a store), else the conversion's."""
        return self.placements.get(layer) or self.manifest.placement_for(layer)

    @property
    def weight_format(self) -> str:
        """The routed experts' MegaMoE weight format, as the manifest records it (``formats.FORMATS``)."""
        return self.manifest.dims.weight_format

    @cached_property
    def family(self) -> ModelFamily:
        """The model family the manifest records (``families.py``)."""
        return families.by_name(self.manifest.family)

    @cached_property
    def num_hidden_layers(self) -> int:
        """Decoder layers of the model, from the copied ``config.json`` (engines number MTP
        blocks after them)."""
        where = self.path / "config.json"
        text = self.family.text(jsonio.read(where, LoadError, "config.json", jsonio.MAX_CONFIG_BYTES), where)
        return Fields(where, LoadError).int(text, self.family.keys["layers"], 0, 1 << 20)

    @cached_property
    def names(self) -> TensorNames:
        """The source checkpoint's tensor names (its family's naming)."""
        return self.family.names(self.num_hidden_layers)


#: ``{"l1_weight": t, "l1_sf": t, ...}`` (keys of :data:`formats.FILE_NAMES`): where a layer's file
#: tensors go, scales in their storage form (``scales.sf_storage`` of the kernel's MN-major view).
Destinations = dict[str, torch.Tensor]


def data_keys(entries: dict[str, TensorEntry]) -> list[str]:
    """The keys of a shard's tensors that are loaded (all but the placement check's logical ids)."""
    return [key for key in entries if key != "logical_ids"]


def check_destinations(where: str, dests: Destinations, entries: dict[str, TensorEntry]) -> None:
    """Caller-owned tensors must take the file bytes as they are: same bytes, shape and a
    contiguous layout (a scale's storage form is contiguous in the kernel layout)."""
    for key, dest in dests.items():
        entry = entries.get(key)
        if entry is None:
            raise LoadError(f"{where}: the conversion has no {key} (its tensors: {', '.join(data_keys(entries))})")
        want = formats.torch_dtype(entry.dtype)
        if dest.dtype.itemsize != want.itemsize or tuple(dest.shape) != tuple(entry.shape) or not dest.is_contiguous():
            raise LoadError(f"{where}: {key} destination is {dest.dtype}{list(dest.shape)} with strides "
                            f"{list(dest.stride())}, but {entry.name} is a contiguous {want}{list(entry.shape)}")


def kernel_form(d: Destinations, fmt: formats.WeightFormat) -> dict[str, torch.Tensor]:
    """File tensors -> the kernel's views (scales MN-major; an SM90 format's routed scales as stored)."""
    return {key: t if not key.endswith("_sf") else scales.sf_kernel_view(fmt, t) if key in formats.ROUTED_KEYS
            else scales.sf_from_storage(t) for key, t in d.items()}
