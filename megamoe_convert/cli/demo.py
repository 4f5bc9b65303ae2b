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
from megamoe_convert.verify import expected_rank_layer


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal bytes and strides, or both absent (an unscaled format's scales)."""
    if a is None or b is None:
        return a is b
    return torch.equal(a, b) and a.stride() == b.stride()


def main(out: str) -> int:
    manifest = read_manifest(Path(out))
    ckpt = Checkpoint.open(manifest.source["path"])
    with FileCache() as files:
        for rank in manifest.ranks:
            for prefix, layer in load_rank(out, rank).items():
                l1, l2 = expected_rank_layer(ckpt, files, MoELayer.parse(layer.key), layer.logical_ids)
                same = all(_same(a, b) for a, b in zip((*layer.l1, *layer.l2), (*l1, *l2), strict=True))
                if not same:
                    print(f"rank {rank} {prefix}: MISMATCH against the source checkpoint")
                    return 1
            sf = layer.l1.sf
            scales = "no l1_sf" if sf is None else f"l1_sf {tuple(sf.shape)} strides {sf.stride()}"
            print(f"rank {rank}: {len(manifest.layers)} layers, slots hold logical experts {list(layer.logical_ids)}; "
                  f"l1 {tuple(layer.l1.weight.shape)} {layer.l1.weight.dtype}, {scales}: identical to the MegaMoE "
                  "layout of the source")
    print_next(out, manifest)
    return 0


def print_next(out: str, manifest: Manifest) -> None:
    """How a GPU node would serve this conversion, and the same steps for the user's own checkpoint."""
    from megamoe_convert.cli.describe import serve_commands

    serve = serve_commands(str(Path(out).resolve()), manifest)
    for engine, how in serve.items():
        if how["servable"]:
            print(f"serve it with {engine} (on Blackwell GPUs): {how['command']}")
    print("next: your checkpoint: megamoe inspect /path/to/checkpoint (the EP sizes that work), then "
          "megamoe convert /path/to/checkpoint OUT --ep-size N, megamoe verify OUT --source /path/to/checkpoint, "
          "megamoe inspect OUT (its serve command)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
