"""The model card ``megamoe push`` writes as the hub's ``README.md``: what the conversion is, for
whom, and usage lines that work as written (the branch pushed to, the ranks it holds). A source
checkpoint's own card (its text and front matter: licence...) is kept inside it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

import huggingface_hub

from megamoe_convert import __version__
from megamoe_convert.output.manifest import Manifest
from megamoe_convert.output.naming import MANIFEST_NAME
from megamoe_convert.source import families

CARD_NAME = "README.md"
CARD_TAGS = ["megamoe", "deepgemm", "mixture-of-experts", "deepseek-v4"]
_CACHE_SNAPSHOT = re.compile(r"models--(?P<owner>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})$")


def _source_label(source: dict[str, Any]) -> tuple[str, str | None]:
    """A source path in the HF cache -> ``("owner/name@commit", "owner/name")``; else the path."""
    path = str(source.get("path", ""))
    m = _CACHE_SNAPSHOT.search(path)
    if m is None:
        return path, None
    repo = f"{m['owner']}/{m['name']}"
    return f"{repo}@{m['commit'][:12]}", repo


def _ranges(values: Sequence[int]) -> str:
    from megamoe_convert.source.layer_spec import _ranges as ranges
    return ranges(list(values))


def model_card(out: Path, manifest: Manifest, repo_id: str, revision: str | None = None) -> str:
    """The hub's README.md: what this conversion is, for whom, and how to use it (the usage
    lines name the branch pushed to and ranks this conversion holds, so they work as written)."""
    placement = manifest.placement
    label, base_model = _source_label(manifest.source)
    metadata: dict[str, Any] = {}
    original = ""
    source_card = out / CARD_NAME
    if source_card.is_file() and any(r.path == CARD_NAME for r in manifest.files):
        card = huggingface_hub.ModelCard.load(source_card, ignore_metadata_errors=True)
        metadata = card.data.to_dict()
        original = card.text.strip()
    metadata["tags"] = list(dict.fromkeys([*(metadata.get("tags") or []), *CARD_TAGS]))
    if base_model:
        metadata["base_model"] = base_model
    data = huggingface_hub.ModelCardData(**metadata)
    decoder = sum(1 for layer in manifest.layers if not layer.is_mtp)
    mtp = len(manifest.layers) - decoder
    by_rank: dict[str, int] = {}
    for record in manifest.files:
        top, _, rest = record.path.partition("/")
        if rest:
            by_rank[top] = by_rank.get(top, 0) + record.size
    per_rank = max(by_rank.values(), default=0)
    ranks = "all" if manifest.ranks == list(range(manifest.ep_size)) else _ranges(manifest.ranks)
    kind = ("vLLM default: physical slot p holds logical expert p % n_routed" if placement.is_default()
            else "custom (EPLB or --placement file)")
    lines = [
        f"# {repo_id}",
        "",
        f"{families.by_name(manifest.family).title} routed experts pre-laid-out for DeepGEMM's **MegaMoE** kernel, "
        f"expert-parallel size "
        f"**{manifest.ep_size}**: one file per (rank, MoE layer), so that every vLLM rank loads its experts with "
        f"no transform. Made by megamoe-convert {__version__}.",
        "",
        "| | |",
        "|---|---|",
        f"| source | `{label}` |",
        f"| ep_size | {manifest.ep_size} (ranks: {ranks}) |",
        f"| MoE layers | {decoder} decoder + {mtp} MTP |",
        f"| experts | {placement.n_logical} logical + {placement.num_redundant} redundant = "
        f"{placement.n_physical} slots, {placement.experts_per_rank} per rank |",
        f"| placement | {kind} |",
        f"| layout version | {manifest.layout_version} (DeepGEMM `transform_weights_for_mega_moe`) |",
        f"| format version | {manifest.format_version} |",
        f"| non-expert weights | {'not included (--experts-only)' if manifest.experts_only else 'included'} |",
        f"| size | {sum(r.size for r in manifest.files) / 1e9:.2f} GB in {len(manifest.files)} files; "
        f"{per_rank / 1e9:.2f} GB of experts per rank |",
        "",
        "## Placement",
        "",
        "| rank | physical slots | logical experts |",
        "|---|---|---|",
    ]
    shown = manifest.ranks if len(manifest.ranks) <= 16 else manifest.ranks[:8]
    for rank in shown:
        start = placement.experts_start(rank)
        ids = ", ".join(map(str, placement.rank_logical_ids(rank)))
        ids = ids if len(ids) <= 120 else ids[:116] + " ..."
        lines.append(f"| {rank} | {start}..{start + placement.experts_per_rank - 1} | {ids} |")
    if len(shown) < len(manifest.ranks):
        lines.append(f"| ... | | ({len(manifest.ranks) - len(shown)} more ranks: see manifest.json) |")
    revision_flag = f" --revision {revision}" if revision else ""
    repo_ref = f"{repo_id}@{revision}" if revision else repo_id
    first_rank = manifest.ranks[0]
    lines += [
        "",
        "## Use",
        "",
        "```bash",
        "pip install /path/to/megamoe-convert   # a checkout of megamoe-convert (not on PyPI)",
        f"megamoe pull {repo_id}{revision_flag} --ranks {_ranges(manifest.ranks)} --local-dir ./model"
        "   # only what these ranks need",
        "```",
        "",
        "```python",
        "from megamoe_convert import load_rank",
        f'experts = load_rank("{repo_ref}", rank={first_rank}, device="cuda:0")'
        f"  # pulls just rank {first_rank} into the HF cache",
        "```",
        "",
        f"`{MANIFEST_NAME}` lists every file with its size and xxh3-128 checksum; `megamoe pull` checks them.",
    ]
    if original:
        lines += ["", "## Original model card", "", original]
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n"
