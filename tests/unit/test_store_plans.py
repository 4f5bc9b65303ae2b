"""``plan`` / ``inspect`` of a store: the same question as on the checkpoint, the same answer. What
its family and engine cannot serve is refused in the checkpoint's words, and the answer's size does
not grow with the store's layer count (a rank's reads are worked out once per placement, not per
layer), so the largest EP size with the most redundant slots is answered like a checkpoint's plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from megamoe_convert.convert.plan import ConvertOptions
from megamoe_convert.convert.run import convert
from megamoe_convert.synth.write import synthesize


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory):
    """Checkpoints and their stores: by preset name (and ``tiny-12``: the tiny preset with 12 layers)."""
    root = tmp_path_factory.mktemp("plans")
    cache: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in cache:
            preset, layers = name.removesuffix("-12"), 12 if name.endswith("-12") else None
            ckpt, store = root / f"{name}-ckpt", root / f"{name}-store"
            synthesize(ckpt, preset, layers=layers, seed=1)
            convert(ckpt, store, ConvertOptions(ep_size=None, fsync=False))
            cache[name] = ckpt, store
        return cache[name]
    return get


def error_after_path(proc) -> str:
    """The error line without its leading path (the checkpoint's or the store's)."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: "), line
    return line.removeprefix("error: ").split(": ", 1)[1]


@pytest.mark.parametrize("preset, flags", [
    ("kimi-k3-tiny", ("--engine", "sglang")),
    ("kimi-k3-tiny", ("--num-redundant-experts", "4")),
    ("v4.1-tiny", ("--engine", "sglang")),
    ("tiny", ("--placement", "PLACEMENT")),
])
def test_plan_of_a_store_refuses_what_the_checkpoints_plan_refuses(made, tmp_path, preset, flags):
    ckpt, store = made(preset)
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps([7, 6, 5, 4, 3, 2, 1, 0]))
    flags = tuple(str(placement) if f == "PLACEMENT" else f for f in flags)
    on_checkpoint = run_cli("plan", ckpt, "--ep-size", 4, *flags, check=False)
    on_store = run_cli("plan", store, "--ep-size", 4, *flags, check=False)
    assert error_after_path(on_store) == error_after_path(on_checkpoint)
    if "--placement" not in flags:
        on_inspect = run_cli("inspect", store, "--ep-size", 4, *flags, check=False)
        assert error_after_path(on_inspect) == error_after_path(on_checkpoint)


def test_a_store_plan_does_not_grow_with_the_layer_count(made):
    sizes = {}
    for name in ("tiny", "tiny-12"):
        _, store = made(name)
        proc = run_cli("plan", store, "--ep-size", 64, "--num-redundant-experts", 56, "--json")
        data = json.loads(proc.stdout)
        assert len(data["ranks"]) == 64 and all(r["read_bytes"] > 0 for r in data["ranks"])
        sizes[name] = len(proc.stdout) - len(json.dumps(data["layers"]))
    assert sizes["tiny-12"] < 1.2 * sizes["tiny"], sizes


def test_a_store_plan_at_the_largest_ep_size_with_the_most_redundant_slots_is_answered(made):
    _, store = made("tiny")
    ranks, redundant = 1 << 16, (1 << 20) - 8  # 16 slots a rank: the most the placement allows
    proc = run_cli("plan", store, "--ep-size", ranks, "--num-redundant-experts", redundant, "--json", timeout=600)
    data = json.loads(proc.stdout)
    assert len(data["ranks"]) == ranks and len(proc.stdout) < 400 * ranks
