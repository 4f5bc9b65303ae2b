"""SGLang 0.5.23's elastic-EP recovery of MegaMoE experts from a per-rank conversion, through its own
EPLB entry point and updater on every surviving rank at once (``sglang_recovery_harness``).

The ranks were installed from a per-rank conversion (EP 4, 4 redundant experts, SGLang's default
placement), then an earlier rebalance left them at the harness's old placement; rank 3 fails holding
the only live copies of experts 6 and 7. The conversion holds them in rank 2's files: each lost slot
gets exactly those byte ranges, and every kernel tensor of every surviving rank equals SGLang's own
fresh build under the new placement. Without a rank file holding a lost expert, or with another
layout identity, recovery refuses in one line before any byte moves."""

from __future__ import annotations

import json
import os
from pathlib import Path

import sglang_harness as h
import sglang_recovery_harness as r
import torch
from test_sglang_recovery import entry

from megamoe_convert.engines.sglang import install
from megamoe_convert.output.seal import seal
from megamoe_convert.serve import store

#: The rank files of the per-rank conversion that hold experts 6 and 7 (its default placement).
HOLDER = "rank-00002-of-00004"


def served(ckpt: Path, converted: Path, rank: int, config) -> torch.nn.Module:
    """Rank ``rank`` installed from ``converted`` under its placement, then as an earlier EPLB rebalance
    to the old placement leaves it: every tensor EPLB moves as SGLang's own build under that placement."""
    with h.patched(rank, r.EP_SIZE, r.REDUNDANT):
        model = h.build_main_model(config, rank, r.REDUNDANT)
        assert install(model, converted, rank=rank) == config.num_hidden_layers
    rebalanced = h.experts_of(r.fresh_build(ckpt, config, rank, r.OLD))
    with torch.no_grad():
        for prefix, module in h.experts_of(model).items():
            for name in h.PARAMETERS:
                getattr(module, name).copy_(getattr(rebalanced[prefix], name))
    r.served_from(model, converted)
    return r.with_routed_weights(model)


def linked_copy(src: Path, dst: Path, skip: set[str] = frozenset(), manifest: dict | None = None) -> Path:
    """``src`` hard-linked into ``dst``, without the files ``skip`` names (relative paths); ``manifest``:
    written resealed instead of the original one."""
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src).as_posix()
        target = dst / rel
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif rel not in skip and not (manifest is not None and rel == "manifest.json"):
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)
    if manifest is not None:
        manifest.pop("manifest_checksum", None)
        (dst / "manifest.json").write_text(seal(manifest))
    return dst


def refused(ckpt: Path, served_path: Path, source: Path) -> tuple[Exception, bool]:
    """Rank 0 served from ``served_path``, its recovery reading ``source``: the error, and whether
    every tensor is as it was."""
    config = h.hf_config(ckpt)
    model = served(ckpt, served_path, 0, config)
    r.served_from(model, source)
    return r.refusal(model, config, entry(hooked=True))


def test_recovery_writes_the_lost_experts_from_a_per_rank_conversion_as_sglangs_fresh_build(
        sglang_ckpt, sglang_converted, monkeypatch):
    config = h.hf_config(sglang_ckpt)
    models = {rank: served(sglang_ckpt, sglang_converted, rank, config) for rank in r.SURVIVORS}
    reads: list[tuple[dict, dict]] = []
    real_fill = store.fill
    monkeypatch.setattr(store, "fill", lambda paths, rs, *rest: (reads.append((paths, rs)),
                                                                   real_fill(paths, rs, *rest))[1])
    asked = r.recover(models, config, entry(hooked=True))
    assert asked == {rank: [] for rank in r.SURVIVORS}  # neither SGLang's backup nor its reload ran
    for rank, model in models.items():
        want = h.experts_of(r.fresh_build(sglang_ckpt, config, rank, r.NEW))
        for prefix, module in h.experts_of(model).items():
            for name, tensor in h.state(module).items():
                h.assert_same_tensor(tensor, h.state(want[prefix])[name], f"rank {rank} {prefix}.{name}")
    files = {Path(p).relative_to(sglang_converted).parts[0] for paths, _ in reads for p in paths.values()}
    assert files == {HOLDER}  # the live rank 2's files hold 6 and 7 under the conversion's placement
    lost_slots = sum(len(slots) for by_layer in r.LOST_SLOTS.values() for slots in by_layer.values())
    module = next(iter(h.experts_of(models[0]).values()))
    per_slot = sum(getattr(module, n)[0].nbytes for n in ("w13_weight", "w2_weight", "mega_w13_weight_scale_utccp",
                                                          "mega_w2_weight_scale_utccp"))
    assert sum(read.nbytes for _, rs in reads for layer in rs.values() for read in layer) == lost_slots * per_slot


def test_recovery_refuses_when_no_rank_file_present_holds_a_lost_expert(sglang_ckpt, sglang_converted, tmp_path):
    missing = f"{HOLDER}/layers.0.safetensors"
    copy = linked_copy(sglang_converted, tmp_path / "without-rank-2", skip={missing})
    error, untouched = refused(sglang_ckpt, sglang_converted, copy)
    assert f"{copy}: expert 6 of layers.0 is in no rank file present: {missing} (missing" in str(error)
    assert untouched


def test_recovery_refuses_a_per_rank_conversion_of_another_layout_identity(sglang_ckpt, sglang_converted, tmp_path):
    manifest = json.loads((sglang_converted / "manifest.json").read_text())
    manifest["layout"]["fingerprints"]["routed"] = "xxh3_64:0123456789abcdef"
    copy = linked_copy(sglang_converted, tmp_path / "other-layout", manifest=manifest)
    error, untouched = refused(sglang_ckpt, sglang_converted, copy)
    assert "records routed layout fingerprint xxh3_64:0123456789abcdef" in str(error)
    assert untouched
