"""The name of one MoE layer (``layers.7``, ``mtp.0``): the key rank files, manifests, the loader and the
engines share, whatever the model family calls the layer. At the bottom of the source stage."""

from __future__ import annotations

import re
from dataclasses import dataclass

#: A layer or expert number as names hold it: canonical (``3``, never ``03``), ASCII digits only.
NUMBER = r"(?:0|[1-9][0-9]{0,8})"


@dataclass(frozen=True, order=True)
class MoELayer:
    """One MoE layer of the checkpoint, by its key ``layers.7`` or ``mtp.0``."""

    is_mtp: bool
    index: int

    @classmethod
    def parse(cls, key: str) -> "MoELayer":
        kind, _, number = key.partition(".")
        if kind not in ("layers", "mtp") or not re.fullmatch(NUMBER, number):
            raise ValueError(f"not a layer key: {key!r} (expected 'layers.N' or 'mtp.N')")
        return cls(kind == "mtp", int(number))

    @property
    def key(self) -> str:
        return f"{'mtp' if self.is_mtp else 'layers'}.{self.index}"

    @property
    def prefix(self) -> str:
        """The layer's tensors in the rank files and the loader's dict key, e.g.
        ``layers.7.ffn.experts`` (DeepSeek-V4's module name, kept for every family)."""
        return f"{self.key}.ffn.experts"

    @property
    def vllm_prefix(self) -> str:
        """What manifests before model families recorded: ``model.layers.7.ffn.experts`` (checked when read)."""
        return f"model.{self.prefix}"
