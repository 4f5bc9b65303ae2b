"""The paths ``bench_load.py`` times, one rank of a conversion into one GPU, and their helpers:
vLLM's way from the source (:func:`baseline_vllm`), ``load_rank`` (:func:`ours`), safetensors' and
fastsafetensors' own readers, and the limits (:class:`HostRead`, :class:`PipeCopy`, :class:`H2D`),
which ``node_forms.py`` times too. ``megamoe_convert`` is imported where a path runs, so the
importing script sets ``sys.path`` first."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

EXPERT = re.compile(r"^(?P<layer>(?:layers|mtp)\.\d+)\.ffn\.experts\.(?P<expert>\d+)\."
                    r"(?P<proj>w[123])\.(?P<kind>weight|scale)$")


# --------------------------------------------------------------------------------------
# Measurement helpers
# --------------------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def io_read_bytes() -> int | None:
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def free_device(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------
# The methods
# --------------------------------------------------------------------------------------

def baseline_vllm(src: Path, rank: int, ep_size: int, device: torch.device) -> tuple[dict, int]:
    """vLLM's way: read everything, keep this rank's experts, transform on the device."""
    from safetensors import safe_open

    from megamoe_convert.layout import scales, transform
    from megamoe_convert.layout.placement import Placement
    from megamoe_convert.source.layers import MoELayer

    index = json.loads((src / "model.safetensors.index.json").read_text())
    config = json.loads((src / "config.json").read_text())
    h, inter, n_experts = config["hidden_size"], config["moe_intermediate_size"], config["n_routed_experts"]
    ids = Placement.default(n_experts, ep_size).rank_logical_ids(rank)
    slot_of = {logical: slot for slot, logical in enumerate(ids)}
    e = len(ids)
    params: dict[str, dict[str, torch.Tensor]] = {}

    def layer_params(key: str) -> dict[str, torch.Tensor]:
        if key not in params:  # vLLM allocates its parameters on the device before loading
            params[key] = {
                "w13": torch.empty((e, 2 * inter, h // 2), dtype=torch.uint8, device=device),
                "w13_s": torch.empty((e, 2 * inter, h // 32), dtype=torch.float32, device=device),
                "w2": torch.empty((e, h, inter // 2), dtype=torch.uint8, device=device),
                "w2_s": torch.empty((e, h, inter // 32), dtype=torch.float32, device=device),
            }
        return params[key]

    bytes_read = 0
    for filename in sorted(set(index["weight_map"].values())):
        with safe_open(src / filename, framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)  # the iterator materialises every tensor
                bytes_read += tensor.numel() * tensor.element_size()
                m = EXPERT.match(name)
                if m is None or int(m["expert"]) not in slot_of:
                    continue
                p, slot, proj = layer_params(m["layer"]), slot_of[int(m["expert"])], m["proj"]
                rows = slice(0, inter) if proj == "w1" else slice(inter, 2 * inter) if proj == "w3" else slice(None)
                data = tensor.view(torch.uint8)
                if m["kind"] == "weight":
                    p["w2" if proj == "w2" else "w13"][slot, rows].copy_(data)
                else:
                    p["w2_s" if proj == "w2" else "w13_s"][slot, rows].copy_(
                        scales.widen_ue8m0_to_fp32(data.to(device)))
    result = {}
    for key, p in params.items():  # finalize_weights: DeepGEMM's transform, on the device
        l1, l2 = transform.transform_experts(p["w13"], scales.narrow_fp32_to_ue8m0(p["w13_s"]),
                                          p["w2"], scales.narrow_fp32_to_ue8m0(p["w2_s"]))
        result[MoELayer.parse(key).prefix] = (l1, l2)
    params.clear()
    sync(device)
    return result, bytes_read


def ours(out: Path, rank: int, device: torch.device) -> dict:
    from megamoe_convert.serve.loader import load_rank

    layers = load_rank(out, rank, device=device)
    if device.type == "cpu":  # lazy mmap views: touch every byte, as a device copy would
        for layer in layers.values():
            for t in (*layer.l1, *layer.l2):
                t.sum()
    sync(device)
    return {k: (v.l1, v.l2) for k, v in layers.items()}


def rank_files(out: Path, rank: int) -> list[Path]:
    manifest = json.loads((out / "manifest.json").read_text())
    pattern = re.compile(rf"^rank-0*{rank}-of-\d+/")
    return sorted(out / f["path"] for f in manifest["files"] if pattern.match(f["path"]))


def safetensors_open(files: list[Path], device: torch.device) -> int:
    from safetensors import safe_open

    n = 0
    keep: list[torch.Tensor] = []
    for path in files:
        with safe_open(path, framework="pt", device=str(device)) as f:
            n += take_all(f, keep)
    sync(device)
    return n


def fastsafetensors_open(files: list[Path], device: torch.device, nogds: bool) -> int:
    from fastsafetensors import fastsafe_open

    keep: list[torch.Tensor] = []
    with fastsafe_open([str(p) for p in files], framework="pt", device=str(device), nogds=nogds) as f:
        n = take_all(f, keep)
        sync(device)
    return n


def take_all(handle: Any, keep: list[torch.Tensor]) -> int:
    """Materialise every tensor of an open safetensors-like handle, kept alive in ``keep``; bytes."""
    n = 0
    for name in handle.keys():
        t = handle.get_tensor(name)
        keep.append(t)
        n += t.numel() * t.element_size()
    return n


class OpenFiles:
    """One reader thread's file descriptors: each file opened on its first read, all closed together."""

    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}

    def __call__(self, path: Path) -> int:
        return self.fds.get(path) or self.fds.setdefault(path, os.open(path, os.O_RDONLY))

    def __enter__(self) -> "OpenFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds.values():
            os.close(fd)


class HostRead:
    """The host read limit: the rank's files read from the page cache into pinned buffers by
    ``threads`` threads, ``piece`` bytes a read (what load_rank's readers do, minus the copy)."""

    def __init__(self, files: list[Path], threads: int, piece: int) -> None:
        self.threads = threads
        self.buffers = [torch.empty(piece, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
                        for _ in range(threads)]
        self.pieces = [(path, start, min(piece, path.stat().st_size - start))
                       for path in files for start in range(0, path.stat().st_size, piece)]

    def run(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from megamoe_convert.source.safetensors_io import read_into

        def worker(k: int) -> None:
            with OpenFiles() as fd_of:
                for path, start, n in self.pieces[k::self.threads]:
                    read_into(fd_of(path), start, self.buffers[k][:n])

        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(worker, range(self.threads)))


class PipeCopy:
    """The page cache -> pinned -> device path with nothing else on it: ``threads`` threads, each
    reading ``piece`` bytes at a time into one of its two pinned buffers and copying that to the
    device on its own stream while it reads into the other. Timed with every rank at once, it is
    the path's ceiling: the reads and the device's DMA share the host's memory bus, which the two
    halves timed apart (:class:`HostRead`, :class:`H2D`) do not."""

    def __init__(self, files: list[Path], threads: int, piece: int, device: torch.device) -> None:
        self.threads, self.device = threads, device
        sizes = [path.stat().st_size for path in files]
        self.dest = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        self.pieces, at = [], 0
        for path, size in zip(files, sizes, strict=True):
            self.pieces += [(path, start, min(piece, size - start), at + start) for start in range(0, size, piece)]
            at += size
        self.buffers = [[torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
                        for _ in range(threads)]
        self.streams = [torch.cuda.Stream(device) for _ in range(threads)]
        self.events = [[torch.cuda.Event() for _ in range(2)] for _ in range(threads)]

    def run(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from megamoe_convert.source.safetensors_io import read_into

        def worker(k: int) -> None:
            stream = self.streams[k]
            with OpenFiles() as fd_of:
                for turn, (path, start, n, at) in enumerate(self.pieces[k::self.threads]):
                    buffer, done = self.buffers[k][turn % 2], self.events[k][turn % 2]
                    done.synchronize()  # its last copy has left it
                    read_into(fd_of(path), start, buffer[:n])
                    with torch.cuda.stream(stream):
                        self.dest[at:at + n].copy_(buffer[:n], non_blocking=True)
                        done.record(stream)
                stream.synchronize()

        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(worker, range(self.threads)))


class H2D:
    """The raw host-to-device limit for ``nbytes``: one big copy from pinned (or pageable) memory."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        self.pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.pageable = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned.fill_(1)
        self.pageable.fill_(1)
        self.dest = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def pinned_copy(self) -> None:
        self.dest.copy_(self.pinned, non_blocking=True)
        sync(self.device)

    def pageable_copy(self) -> None:
        self.dest.copy_(self.pageable)
        sync(self.device)


def equal_layers(a: dict, b: dict) -> bool:
    if sorted(a) != sorted(b):
        return False
    for key in a:
        for x, y in zip((*a[key][0], *a[key][1]), (*b[key][0], *b[key][1]), strict=True):
            if x.shape != y.shape or x.stride() != y.stride() or x.dtype != y.dtype or not torch.equal(x, y):
                return False
    return True
