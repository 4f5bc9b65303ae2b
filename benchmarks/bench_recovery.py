#!/usr/bin/env python3
"""Bringing experts back on a node: from a store, against the engines' own ways, every rank at once.

A checkpoint of real expert dims (``--preset``, cut to ``--layers`` MoE layers of ``--experts``
experts) and its store are made once. Then, one process per GPU, each rank allocates its MegaMoE
tensors as SGLang's build leaves them (``w13_weight``, ``w2_weight``, the UTCCP scales and the scales
without UTCCP, EP ``--ep-size`` with SGLang's default placement), all ranks are released together
and each fills them by one method; a node's time is its slowest rank's. Methods, page cache warm
(the files read twice first) and cold (dropped before each, as root):

  recover_store   ``--lost K`` slots of every layer on every rank, the lost experts' byte ranges
                  from the store (``engines/sglang/recovery.restore``: what SGLang's EPLB recovery
                  runs with megamoe-convert, the same functions, the same six tensors);
  recover_per_rank the same slots from a per-rank conversion of the same EP size whose placement puts
                  each rank's experts in the next rank's files: each lost expert's slot blocks read
                  from another rank's file, as from a failed rank's (``--source`` picks these two);
  recover_peer    the same slots copied from a peer GPU's tensors (CUDA IPC, ``copy_`` between
                  devices: an NVLink peer that still holds them; warm only: no file is read);
  join_store      a joining rank's every slot from the store (what ``install`` reads for a joiner);
  join_checkpoint the joiner's own way: every expert tensor of the checkpoint read (SGLang's joiner
                  reads the whole checkpoint), its slots laid out on the GPU by megamoe-convert's
                  transform (the bytes SGLang's build makes).

Every method's tensors are checked against ``join_checkpoint``'s (the lost slots for recovery).
The last line printed is JSON (``--save FILE`` writes it too).

    PYTHONPATH=. python3 benchmarks/bench_recovery.py --work /tmp/recovery            # 4 GPUs
    PYTHONPATH=. python3 benchmarks/bench_recovery.py --smoke --work /tmp/x           # CPU, tests/e2e
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, bench_config, drop_page_cache, emit_summary, ensure_checkpoint  # noqa: E402

sys.path.insert(0, str(REPO))
METHODS = ("recover_store", "recover_per_rank", "recover_peer", "join_store", "join_checkpoint")
#: ``--source``: what each recovery method reads.
SOURCES = {"store": "recover_store", "per-rank": "recover_per_rank"}


# --------------------------------------------------------------------------------------
# In each rank's process
# --------------------------------------------------------------------------------------

def modules(store: Path, ep_size: int, rank: int, device: str) -> tuple[Any, dict[int, Any], dict[int, list[int]]]:
    """The store opened, the rank's MegaMoE tensors by layer id (shaped as SGLang's build leaves them),
    and every layer's placement row."""
    import types

    import torch

    from megamoe_convert.layout.placement import Placement
    from megamoe_convert.serve import store as store_reader
    from megamoe_convert.serve.loader import open_converted
    from megamoe_convert.source import formats

    converted = open_converted(store)
    built, rows = {}, {}
    for layer_id, layer in enumerate(converted.manifest.layers):
        placement = Placement.default(converted.manifest.dims.experts_of(layer), ep_size)
        rows[layer_id] = list(placement.physical_to_logical)
        specs = store_reader.slot_specs(converted.manifest, layer, placement.experts_per_rank)
        t = {key: torch.zeros(spec.shape, dtype=formats.torch_dtype(spec.dtype), device=device)
             for key, spec in specs.items()}
        sf1, sf2 = t["l1_sf"].transpose(1, 2), t["l2_sf"].transpose(1, 2)  # MN-major, as the kernel's
        built[layer_id] = types.SimpleNamespace(
            w13_weight=t["l1_weight"], w2_weight=t["l2_weight"], mega_w13_weight_scale_utccp=sf1,
            mega_w2_weight_scale_utccp=sf2, w13_weight_scale_inv=torch.zeros_like(sf1),
            w2_weight_scale_inv=torch.zeros_like(sf2), num_local_experts=placement.experts_per_rank,
            layer_name=f"model.layers.{layer_id}.mlp.experts", _mega_moe_sm90_fp8_weights=False)
    return converted, built, rows


def recover_store(converted: Any, built: dict, rows: dict, rank: int, lost: int) -> None:
    """The rank's first ``lost`` slots of every layer from ``converted`` (a store or a per-rank
    conversion), through recovery's own functions."""
    from megamoe_convert.engines.sglang import recovery

    local = next(iter(built.values())).num_local_experts
    missing = {i: rows[i][rank * local:rank * local + lost] for i in built}
    source = recovery.Source(converted, dict(enumerate(converted.manifest.layers)))
    recovery.restore(source, built, rows, missing, rank)


def join_store(converted: Any, built: dict, rows: dict, rank: int) -> None:
    from megamoe_convert.engines.sglang import recovery
    from megamoe_convert.serve.store import load_slots

    local = next(iter(built.values())).num_local_experts
    layers = dict(enumerate(converted.manifest.layers))
    loaded = load_slots(converted, {layers[i]: rows[i][rank * local:(rank + 1) * local] for i in built},
                        device=next(iter(built.values())).w13_weight.device)
    for i, module in built.items():
        recovery.write_slots(module, range(local), loaded[layers[i].prefix].tensors)


def join_checkpoint(ckpt: Path, converted: Any, built: dict, rows: dict, rank: int) -> None:
    """Every expert tensor of the checkpoint read, this rank's slots transformed on its device."""
    import torch

    from megamoe_convert.engines.sglang import recovery
    from megamoe_convert.layout.transform import transform_experts
    from megamoe_convert.source.safetensors_io import read_header

    data: dict[str, torch.Tensor] = {}
    for path in sorted(ckpt.glob("*.safetensors")):
        header = read_header(path)
        raw = torch.from_file(str(path), size=header.file_size, dtype=torch.uint8)  # the whole file, read
        data.update({name: raw[e.begin:e.end] for name, e in header.tensors.items() if ".experts." in name})
    names, device = converted.names, next(iter(built.values())).w13_weight.device
    for i, module in built.items():
        layer, local = converted.manifest.layers[i], module.num_local_experts
        ids = rows[i][rank * local:(rank + 1) * local]

        def stack(projs: tuple[str, ...], kind: str, rows_of: Any, ids: list[int] = ids, layer: Any = layer) -> Any:
            return torch.stack([torch.cat([data[names.expert(layer, e, p, kind)].view(rows_of(p), -1) for p in projs])
                                for e in ids]).to(device)

        shape = {"w1": module.w13_weight.shape[1] // 2, "w3": module.w13_weight.shape[1] // 2,
                 "w2": module.w2_weight.shape[1]}
        l1, l2 = transform_experts(stack(("w1", "w3"), "weight", shape.get), stack(("w1", "w3"), "scale", shape.get),
                                   stack(("w2",), "weight", shape.get), stack(("w2",), "scale", shape.get))
        recovery.write_slots(module, range(local), {"l1_weight": l1.weight, "l1_sf": l1.sf, "l2_weight": l2.weight,
                                                    "l2_sf": l2.sf})


KERNEL_TENSORS = ("w13_weight", "w2_weight", "mega_w13_weight_scale_utccp", "mega_w2_weight_scale_utccp",
                  "w13_weight_scale_inv", "w2_weight_scale_inv")


def digest(built: dict, slots: int) -> list[list[int]]:
    """By slot, a position-weighted checksum of its bytes in every tensor of every layer."""
    import torch

    out = []
    for slot in range(slots):
        sums = []
        for module in built.values():
            for name in KERNEL_TENSORS:
                t = getattr(module, name)[slot].contiguous().view(-1).view(torch.uint8).long()
                sums.append(int((t * (1 + torch.arange(t.numel(), device=t.device) % 251)).sum().item()))
        out.append(sums)
    return out


def rank_main(rank: int, args: dict, barrier: Any, results: Any, peers: Any) -> None:
    import torch

    device = f"cuda:{rank}" if args["device"] == "cuda" else "cpu"
    if args["device"] == "cuda":
        torch.cuda.set_device(rank)
    converted, built, rows = modules(Path(args["store"]), args["ep_size"], rank, device)
    method, lost = args["method"], args["lost"]
    per_rank = None
    if method == "recover_per_rank":
        from megamoe_convert.serve.loader import open_converted

        per_rank = open_converted(args["per_rank"])
    peer = None
    if method == "recover_peer":  # each rank shares its tensors with the next, takes the previous one's
        join_store(converted, built, rows, rank)  # the peer holds its experts (not timed)
        peers[rank].put({i: tuple(getattr(m, name) for name in KERNEL_TENSORS) for i, m in built.items()})
        peer = peers[(rank - 1) % args["ranks"]].get()
    barrier.wait()
    start = time.perf_counter()
    if method == "recover_store":
        recover_store(converted, built, rows, rank, lost)
    elif method == "recover_per_rank":
        recover_store(per_rank, built, rows, rank, lost)
    elif method == "recover_peer":
        for i, module in built.items():
            for dst, src in zip([getattr(module, name) for name in KERNEL_TENSORS], peer[i], strict=True):
                dst[:lost].copy_(src[:lost], non_blocking=True)
    elif method == "join_store":
        join_store(converted, built, rows, rank)
    else:
        join_checkpoint(Path(args["ckpt"]), converted, built, rows, rank)
    if args["device"] == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    slots = lost if method.startswith("recover") else built[0].num_local_experts
    results.put((rank, seconds, digest(built, slots)))
    barrier.wait()  # a peer's tensors stay alive until every rank has copied them


def run_method(args: dict, method: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(args["ranks"]), ctx.Queue()
    peers = [ctx.Queue() for _ in range(args["ranks"])]
    procs = [ctx.Process(target=rank_main, args=(r, {**args, "method": method}, barrier, results, peers))
             for r in range(args["ranks"])]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=args["timeout"]) for _ in procs)
    for p in procs:
        p.join()
    return {"node_s": max(s for _, s, _ in got), "rank_s": [s for _, s, _ in got], "digests": [d for _, _, d in got]}


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------

def prepare(work: Path, args: argparse.Namespace, sources: list[str]) -> tuple[Path, Path, Path, dict]:
    """The checkpoint, its store and (``per-rank`` among ``sources``) its per-rank conversion at
    ``--ep-size`` under SGLang's rule, each rank's experts of the default placement in the next rank's files."""
    import json

    from megamoe_convert.convert.plan import ConvertOptions
    from megamoe_convert.convert.run import convert

    config = bench_config(args.preset, args.layers, args.experts, 0, 512)
    ckpt, store, per_rank = work / "ckpt", work / "store", work / f"per-rank-ep{args.ep_size}"
    ensure_checkpoint(ckpt, config)
    if not (store / "manifest.json").exists():
        convert(ckpt, store, ConvertOptions(ep_size=None, experts_only=True, fsync=False))
    if "per-rank" in sources and not (per_rank / "manifest.json").exists():
        n, local = args.experts, args.experts // args.ep_size
        (work / "next-rank.json").write_text(json.dumps([(p - local) % n for p in range(n)]))
        convert(ckpt, per_rank, ConvertOptions(ep_size=args.ep_size, placement_file=work / "next-rank.json",
                                               engine="sglang", experts_only=True, fsync=False))
    return ckpt, store, per_rank, config


def warm(paths: list[Path]) -> None:
    for _ in range(2):
        for path in paths:
            for f in sorted(p for p in path.rglob("*") if p.is_file()):
                with open(f, "rb") as fh:
                    while fh.read(1 << 24):
                        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--preset", default="flash")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--ep-size", type=int, default=4)
    parser.add_argument("--lost", type=int, default=2, help="lost slots of every layer on every rank")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--source", default="store,per-rank",
                        help=f"what recovery reads, comma-separated: {', '.join(SOURCES)}")
    parser.add_argument("--save")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny, two ranks, warm only (tests/e2e)")
    args = parser.parse_args()
    if args.smoke:
        args.preset, args.layers, args.experts, args.ep_size, args.rounds = "tiny", 1, 8, 2, 1
    sources = args.source.split(",")
    if unknown := sorted(set(sources) - set(SOURCES)):
        parser.error(f"--source {unknown[0]!r}: choose among {', '.join(SOURCES)}")
    device = "cpu" if args.smoke else "cuda"
    ckpt, store, per_rank, config = prepare(args.work, args, sources)
    common = {"ckpt": str(ckpt), "store": str(store), "per_rank": str(per_rank), "ep_size": args.ep_size,
              "lost": args.lost, "device": device, "ranks": args.ep_size, "timeout": args.timeout}
    skipped = {"recover_peer"} if device != "cuda" else set()
    skipped |= {method for source, method in SOURCES.items() if source not in sources}
    methods = [m for m in METHODS if m not in skipped]
    rows, cold_ok = [], None
    for round_ in range(args.rounds):
        for cache in ("warm", "cold") if not args.smoke else ("warm",):
            for method in methods if round_ % 2 == 0 else methods[::-1]:
                if cache == "cold" and method == "recover_peer":
                    continue
                if cache == "warm":
                    warm([store] if method.endswith("store") else [per_rank] if method == "recover_per_rank"
                         else [ckpt] if method == "join_checkpoint" else [])
                else:
                    cold_ok = drop_page_cache()
                rows.append({"round": round_, "cache": cache, "method": method, **run_method(common, method)})
                print(f"round {round_} {cache:4} {method:16} node {rows[-1]['node_s']:.3f} s", flush=True)
    reference = next(r["digests"] for r in rows if r["method"] == "join_checkpoint")
    same = all(r["digests"] == reference if r["method"].startswith("join") else
               [d[:args.lost] for d in reference] == r["digests"]
               for r in rows if r["method"] != "recover_peer")  # a peer's slots hold other experts
    for row in rows:
        del row["digests"]
    summary = {"bench": "recovery", "config": config, "ep_size": args.ep_size, "lost_per_layer": args.lost,
               "ranks": args.ep_size, "sources": sources, "device": device, "gpu": _gpu(device),
               "cold_dropped": cold_ok,
               "identical": same, "expert_bytes": _expert_bytes(store), "rows": rows}
    emit_summary(summary, args.save)


def _gpu(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def _expert_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in (store / "experts").glob("*.safetensors"))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
