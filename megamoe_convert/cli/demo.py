"""``python -m megamoe_convert.cli.demo OUT``: load every rank of a conversion and check it.

The last step of ``make demo``: shows what a serving rank receives (dtype, shape, strides),
proves, against the source checkpoint, that the bytes are exactly the MegaMoE layout, and ends
with the command that serves the conversion and the next step: the user's own checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from megamoe_convert.output.manifest import Manifest, read_manifest
from megamoe_convert.serve.loader import load_rank
from megamoe_convert.source.checkpoint import Checkpoint
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import FileCache
from megamoe_convert.ui import command, say
from megamoe_convert.verify import expected_rank_layer


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal bytes and strides, or both absent (an unscaled format's scales)."""
    if a is None or b is None:
        return a is b
    return torch.equal(a, b) and a.stride() == b.stride()


def main(out: str) -> int:
    manifest = read_manifest(Path(out))
    ckpt = Checkpoint.open(manifest.source["path"])
    say(placement_note(manifest))
    with FileCache() as files:
        for rank in manifest.ranks:
            for prefix, layer in load_rank(out, rank).items():
                l1, l2 = expected_rank_layer(ckpt, files, MoELayer.parse(layer.key), layer.logical_ids)
                same = all(_same(a, b) for a, b in zip((*layer.l1, *layer.l2), (*l1, *l2), strict=True))
                if not same:
                    say(f"rank {rank} {prefix}: MISMATCH against the source checkpoint")
                    return 1
            sf = layer.l1.sf
            scales = "no l1_sf" if sf is None else f"l1_sf {tuple(sf.shape)} strides {sf.stride()}"
            start = manifest.placement_for(MoELayer.parse(layer.key)).experts_start(rank)
            say(f"rank {rank}: {len(manifest.layers)} layers, slots {start}-{start + len(layer.logical_ids) - 1} hold "
                 f"logical experts {list(layer.logical_ids)}; l1 {tuple(layer.l1.weight.shape)} "
                 f"{layer.l1.weight.dtype}, {scales}: identical to the MegaMoE layout of the source")
    print_next(out, manifest)
    return 0


def placement_note(manifest: Manifest) -> str:
    """Why a rank holds the experts it does: the slots, and where the redundant ones come from."""
    p = manifest.placement
    slots = (f"{p.n_logical} experts + {p.num_redundant} redundant = {p.n_physical} slots"
             if p.num_redundant else f"{p.n_physical} slots for {p.n_logical} experts")
    rule = (f"slot s holds expert s mod {p.n_logical} (vLLM's default placement)" if p.is_default() else
            "each slot holds the expert manifest.json's placement gives it")
    redundant = (f", so slots {p.n_logical}-{p.n_physical - 1} hold a second copy of experts "
                 f"{_ids(p.physical_to_logical[p.n_logical:])}: the redundant experts EPLB balances the load with"
                 if p.num_redundant and p.is_default() else "")
    return f"placement: {slots}, {p.experts_per_rank} per rank; {rule}{redundant}"


def _ids(ids: tuple[int, ...]) -> str:
    return ", ".join(map(str, ids))


def print_next(out: str, manifest: Manifest) -> None:
    """How a GPU node would serve this conversion, and the same steps for the user's own checkpoint."""
    from megamoe_convert.cli.describe import serve_commands

    serve = serve_commands(str(Path(out).resolve()), manifest)
    for engine, how in serve.items():
        if how["servable"]:
            say(f"serve it with {engine} (on {' or '.join(how['gpus'])} GPUs):")
            command(how["command"])
    say("next, your own checkpoint: the EP sizes that work, convert, verify, then its serve command:")
    for step in ("megamoe inspect /path/to/checkpoint", "megamoe convert /path/to/checkpoint OUT --ep-size N",
                 "megamoe verify OUT --source /path/to/checkpoint", "megamoe inspect OUT"):
        command(step)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
