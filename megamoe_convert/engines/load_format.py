"""What every engine's ``--load-format megamoe`` shares: the engine's default loader underneath
reads the converted directory's non-expert shards as plain safetensors, minus the routed-expert
tensors and the shared experts that ``install`` put in place (both from the rank's own shards),
and never fetches the rank folders of a hub repo.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from megamoe_convert.engines.driver import Installed
from megamoe_convert.output import marker

LOAD_FORMAT = "megamoe"
#: What the engine's own weight iterator must never fetch from a hub repo: the rank folders
#: (``install`` pulls just this rank's shards itself).
RANK_FILES_PATTERN = "rank-*-of-*/*"
#: Nor a store's expert files (``install`` reads just this rank's slots of them itself).
STORE_FILES_PATTERN = "experts/*"
#: Checkpoint tensor names of routed experts (what the megamoe load format never reads).
EXPERT_TENSOR_NAME = re.compile(r"\.experts\.(\d+\.)?w[123]")
#: Set on a model once its conversion's experts are installed (by the load format or by the
#: model's own ``load_weights``), so that the other does not install them again.
INSTALLED_ATTR = "megamoe_installed"


def is_unmarked_conversion(path: Any) -> bool:
    """A local directory converted before the marker existed: a megamoe manifest, no marker."""
    manifest = Path(str(path)) / marker.MANIFEST_NAME
    try:
        data = json.loads(manifest.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "layout_version" in data and "placement" in data


def without_expert_tensors(weights: Iterable[tuple[str, torch.Tensor]], installed: Installed | None = None,
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """The default safetensors iterator, minus routed-expert tensors and the shared-expert
    tensors ``installed`` put in place from the rank files (``Installed.skip``)."""
    skip = installed.skip if installed else frozenset()
    return ((name, t) for name, t in weights if not EXPERT_TENSOR_NAME.search(name) and name not in skip)


def as_safetensors_config(load_config: Any) -> Any:
    """A copy of the engine's ``LoadConfig`` for the default loader underneath, which knows only
    its own formats (``megamoe`` would be unknown): plain safetensors, rank folders ignored."""
    if load_config is None:
        return None
    config = copy.copy(load_config)
    config.load_format = "safetensors"  # both engines' LoadFormat values compare equal to their strings
    ignore = config.ignore_patterns
    config.ignore_patterns = [*([ignore] if isinstance(ignore, str) else (ignore or [])), RANK_FILES_PATTERN,
                             STORE_FILES_PATTERN]
    return config
