"""``python -m megamoe_convert.cli.demo OUT``: load every rank of a conversion and check it.

The last step of ``make demo``: shows what a serving rank receives (dtype, shape, strides)
and proves, against the source checkpoint, that the bytes are exactly the MegaMoE layout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from megamoe_convert.output.manifest import read_manifest
from megamoe_convert.serve.loader import load_rank
from megamoe_convert.source.checkpoint import Checkpoint
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import FileCache
from megamoe_convert.verify import expected_rank_layer


def main(out: str) -> int:
    manifest = read_manifest(Path(out))
    ckpt = Checkpoint.open(manifest.source["path"])
    with FileCache() as files:
        for rank in manifest.ranks:
            for prefix, layer in load_rank(out, rank).items():
                l1, l2 = expected_rank_layer(ckpt, files, MoELayer.parse(layer.key), layer.logical_ids)
                same = all(torch.equal(a, b) and a.stride() == b.stride()
                           for a, b in zip((*layer.l1, *layer.l2), (*l1, *l2)))
                if not same:
                    print(f"rank {rank} {prefix}: MISMATCH against the source checkpoint")
                    return 1
            print(f"rank {rank}: {len(manifest.layers)} layers, slots hold logical experts {list(layer.logical_ids)}; "
                  f"l1 {tuple(layer.l1.weight.shape)} {layer.l1.weight.dtype}, l1_sf {tuple(layer.l1.sf.shape)} "
                  f"strides {layer.l1.sf.stride()}: identical to the MegaMoE layout of the source")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
