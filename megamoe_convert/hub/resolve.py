"""A conversion named by a local path or a hub repo id, opened for loading.

Apart from ``pull`` so that a local path, what an engine's start-up nearly always passes, never
imports the hub client: a first call pays every import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch

from megamoe_convert.serve import loader
from megamoe_convert.serve.converted import ConvertedModel, ExpertLayer


def open_converted(out: "Path | str | ConvertedModel", ranks: Iterable[int] | None = None) -> ConvertedModel:
    """A local conversion or store, or a hub repo id (just ``ranks`` pulled first), opened once."""
    if isinstance(out, ConvertedModel) or Path(out).is_dir():  # local: no hub client to import
        return loader.open_converted(out)
    from megamoe_convert.hub import pull

    return loader.open_converted(pull.resolve_converted(out, None if ranks is None else list(ranks)))


def load_rank(out: "Path | str | ConvertedModel", rank: int, device: str | torch.device = "cpu",
              **options: Any) -> dict[str, ExpertLayer]:
    """:func:`megamoe_convert.serve.loader.load_rank`, where ``out`` may also be a hub repo id
    (``owner/name[@revision]``): just this rank is pulled into the HF cache first."""
    converted = open_converted(out, [rank]) if isinstance(rank, int) and not isinstance(rank, bool) else out
    return loader.load_rank(converted, rank, device, **options)
