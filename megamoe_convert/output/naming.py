"""The names of everything a conversion writes below OUT, in one place.

Every reader (loader, store, hub, verify, the engines) finds files by these names, and the
only code that deletes (``clearing``) deletes nothing whose path does not fit them: a path
that is not one of :func:`is_own_path`'s shapes is never the tool's, whatever a journal or a
manifest says.
"""

from __future__ import annotations

import re
from pathlib import Path

from megamoe_convert.source.layers import MoELayer

MANIFEST_NAME = "manifest.json"
#: A store's ``engine`` in its manifest: it holds no engine's placement; the engine's own one is
#: read at install. Here, not in the manifest's module, so an engine's config hook reads it cheaply.
ANY_ENGINE = "any"
#: Hidden folder for conversion state (locks, journal, plan); never read by loaders.
STATE_DIR = ".megamoe"
#: The store's folder (``convert`` without ``--ep-size``): one file per MoE layer holding its
#: logical experts once, expert-major, in the kernel layout (any rank's tensors are ranges of it).
STORE_DIR = "experts"
#: What a part of a split conversion (``--shard``) writes instead of ``manifest.json``.
PART_GLOB = "manifest.part-*-of-*.json"
#: Where ``merge`` keeps the part manifests it consumed (relative to OUT), so merging is repeatable.
MERGED_PARTS_DIR = f"{STATE_DIR}/parts"

#: Folders below OUT that an engine writes into the conversion it serves, the user's data: never
#: read as part of the conversion, published, reported or deleted (SGLang's ``--load-format
#: presharded`` dumps every rank's post-processed weights into ``OUT/presharded/``).
USER_DIRS = ("presharded",)

#: A rank's folder, or the store's.
RANK_DIR = re.compile(r"rank-[0-9]{5,}-of-[0-9]{5,}|experts")
_RANK_FILE = re.compile(r"(?:rank-[0-9]{5,}-of-[0-9]{5,}|experts)/(?:layers|mtp)\.(?:0|[1-9][0-9]*)\.safetensors")
_NON_EXPERT_SHARD = re.compile(r"model-[0-9]{5,}-of-[0-9]{5,}\.safetensors")
_TOP_LEVEL = re.compile(r"[^/\\\x00-\x1f\x7f]+")
_PART_MANIFEST = re.compile(r"manifest\.part-[0-9]{5,}-of-[0-9]{5,}\.json")


def rank_dir_name(rank: int, ep_size: int) -> str:
    return f"rank-{rank:05d}-of-{ep_size:05d}"


def rank_file(rank: int, ep_size: int, layer: MoELayer) -> str:
    """Relative path of one rank's shard for one MoE layer."""
    return f"{rank_dir_name(rank, ep_size)}/{layer.key}.safetensors"


def store_file(layer: MoELayer) -> str:
    """Relative path of one MoE layer's file in a store."""
    return f"{STORE_DIR}/{layer.key}.safetensors"


def part_name(index: int, count: int) -> str:
    return f"part-{index:05d}-of-{count:05d}"


def part_manifest_name(index: int, count: int) -> str:
    """What a part writes instead of ``manifest.json`` (which only ``merge`` writes)."""
    return f"manifest.{part_name(index, count)}.json"


def is_part_manifest(name: str) -> bool:
    return bool(_PART_MANIFEST.fullmatch(name))


def is_shard_path(rel: str) -> bool:
    """A rank shard or a non-expert shard, by the tool's exact naming scheme."""
    return bool(_RANK_FILE.fullmatch(rel) or _NON_EXPERT_SHARD.fullmatch(rel))


def is_user_path(rel: str) -> bool:
    """Whether ``rel`` lies in one of :data:`USER_DIRS` (the user's, whatever its name)."""
    return rel.partition("/")[0] in USER_DIRS


def is_own_path(rel: str) -> bool:
    """Whether ``rel`` fits this tool's naming scheme: a rank shard (``rank-NNNNN-of-NNNNN/
    layers.L.safetensors``) or a visible top-level file name. Never absolute, never ``..``, never
    in the user's folders (:data:`USER_DIRS`)."""
    if is_user_path(rel):
        return False
    if is_shard_path(rel):
        return True
    return bool(_TOP_LEVEL.fullmatch(rel)) and not rel.startswith(".")


def owned_path(out: Path, rel: str) -> Path | None:
    """``OUT/rel`` if ``rel`` fits the naming scheme and resolves inside OUT (no symlinked
    folder on the way); else ``None``: the only paths the tool reuses or deletes."""
    if not is_own_path(rel):
        return None
    path = out / rel
    if path.parent.resolve() != out.resolve() / Path(rel).parent:
        return None
    return path


def format_ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the ``--ranks`` syntax)."""
    parts: list[list[int]] = []
    for i in ids:
        if parts and parts[-1][1] == i - 1:
            parts[-1][1] = i
        else:
            parts.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)
