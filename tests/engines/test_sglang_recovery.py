"""SGLang 0.5.23's elastic-EP recovery of MegaMoE experts, through its own EPLB entry point and
updater on every surviving rank at once (``sglang_recovery_harness``): EP 4 with 4 redundant experts,
rank 3 fails holding the only copies of experts 6 and 7. Without megamoe-convert SGLang's own path
leaves their new slots corrupt; with it (the plugin's hook, a store) every kernel tensor of every
surviving rank equals SGLang's own fresh build under the new placement; without a store that can
serve, recovery refuses before any byte moves (a per-rank conversion: ``test_sglang_recovery_per_rank``)."""

from __future__ import annotations

import json
import os
import types

import pytest
import sglang_harness as h
import sglang_recovery_harness as r
import torch
from sglang_model_classes_harness import plugins

from megamoe_convert.engines.sglang import install, recovery
from megamoe_convert.output.seal import seal


def entry(hooked: bool):
    """SGLang's recovery entry point as its EPLB manager calls it: hooked by the plugin, or SGLang's own."""
    from sglang.srt.eplb import eplb_manager

    plugins()
    wrapped = eplb_manager.update_expert_location_with_recovery
    assert getattr(wrapped, "__wrapped__", None) is not None  # the plugin's hook, applied by load_plugins
    return wrapped if hooked else wrapped.__wrapped__


def served(ckpt, source, rank, config):
    """Rank ``rank`` under the old placement: installed from ``source`` (a store), or SGLang's own load."""
    with h.patched(rank, r.EP_SIZE, r.REDUNDANT, **r.table_args(r.OLD)):
        model = h.build_main_model(config, rank, r.REDUNDANT)
        if source is None:
            h.sglang_load(model, ckpt)
        else:
            assert install(model, source, rank=rank) == config.num_hidden_layers
            r.served_from(model, source)
    return r.with_routed_weights(model)


def lost_slot_differs(got, want, layer, slots, where):
    for name, tensor in h.state(got).items():
        for slot in slots:
            assert not torch.equal(tensor[slot], h.state(want)[name][slot]), f"{where} layer {layer} {name}[{slot}]"


def test_recovery_writes_the_lost_experts_from_the_store_as_sglangs_fresh_build_on_every_rank(
        sglang_ckpt, sglang_store, monkeypatch):
    config = h.hf_config(sglang_ckpt)
    models = {rank: served(sglang_ckpt, sglang_store, rank, config) for rank in r.SURVIVORS}
    written: dict[int, dict[str, list[int]]] = {rank: {} for rank in r.SURVIVORS}
    real_write = recovery.write_slots

    def recording(module, slots, tensors):
        written[module.moe_ep_rank][module.layer_id] = list(slots)
        real_write(module, slots, tensors)

    monkeypatch.setattr(recovery, "write_slots", recording)
    asked = r.recover(models, config, entry(hooked=True))
    assert asked == {rank: [] for rank in r.SURVIVORS}  # neither SGLang's backup nor its reload ran
    assert written == r.LOST_SLOTS  # only the slots no live peer could fill
    for rank, model in models.items():
        want = h.experts_of(r.fresh_build(sglang_ckpt, config, rank, r.NEW))
        for prefix, module in h.experts_of(model).items():
            for name, tensor in h.state(module).items():
                h.assert_same_tensor(tensor, h.state(want[prefix])[name], f"rank {rank} {prefix}.{name}")
            assert h.shares_storage(module.mega_l1_weights[1], module.mega_w13_weight_scale_utccp)


def test_sglangs_own_recovery_leaves_the_lost_experts_slots_corrupt(sglang_ckpt, sglang_store):
    """The same failure through SGLang's own entry point: its updater writes its scratch buffers into
    the lost experts' slots, in all six tensors, and asks for a reload (its checkpoint reload or DRAM
    backup) that writes the loader's layout."""
    config = h.hf_config(sglang_ckpt)
    models = {rank: served(sglang_ckpt, sglang_store, rank, config) for rank in r.SURVIVORS}
    asked = r.recover(models, config, entry(hooked=False))
    assert [kind for kind, _ in asked[0]] == ["disk"] and [kind for kind, _ in asked[1]] == ["disk"]
    assert asked[2] == []
    for rank in (0, 1):
        want = h.experts_of(r.fresh_build(sglang_ckpt, config, rank, r.NEW))
        for prefix, module in h.experts_of(models[rank]).items():
            layer = module.layer_id
            lost_slot_differs(module, want[prefix], layer, r.LOST_SLOTS[rank][layer], f"rank {rank}")


def test_sglangs_expert_backup_does_not_know_deepseek_v4s_expert_names(sglang_ckpt):
    """SGLang's DRAM backup client, given the names a DeepSeek-V4 checkpoint holds, refuses them."""
    from sglang.srt.elastic_ep.expert_backup_client import ExpertBackupClient

    config = h.hf_config(sglang_ckpt)
    client = ExpertBackupClient.__new__(ExpertBackupClient)
    info = types.SimpleNamespace(weight_ptr=0, byte_size=16)
    client.engine_num, client.moe_ep_size, client.moe_ep_rank = 1, r.EP_SIZE, 0
    client.model_config = types.SimpleNamespace(hf_config=config)
    client.dram_map_list = [{"layers.0.ffn.experts.6.w1.scale": info}]
    with h.patched(0, r.EP_SIZE, r.REDUNDANT, **r.table_args(r.OLD)):
        h.set_expert_location(config, 0)
        with pytest.raises(RuntimeError, match="Unknown weight name"):
            client.update_weights(None)


def test_recovery_refuses_a_model_not_served_from_a_conversion_before_any_byte_moves(sglang_ckpt):
    config = h.hf_config(sglang_ckpt)
    model = served(sglang_ckpt, None, 0, config)
    error, untouched = r.refusal(model, config, entry(hooked=True))
    assert str(error) == ("SGLang's EPLB recovery must restore MegaMoE experts that lived only on failed ranks "
                          "(layer 0: [6]; layer 1: [7]), which its own backup and checkpoint reload would write in "
                          "the wrong layout, and the model was not served from a megamoe-convert conversion: "
                          "refusing to serve garbage; serve it from a store or a per-rank conversion")
    assert untouched


def test_recovery_refuses_a_store_of_another_layout_identity(sglang_ckpt, sglang_store, tmp_path):
    """A store whose manifest records another layout fingerprint than SGLang's own build makes."""
    other = tmp_path / "other-layout"
    for path in sglang_store.rglob("*"):
        target = other / path.relative_to(sglang_store)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.name != "manifest.json":
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)
    manifest = json.loads((sglang_store / "manifest.json").read_text())
    manifest["layout"]["fingerprints"]["routed"] = "xxh3_64:0123456789abcdef"
    manifest.pop("manifest_checksum")
    (other / "manifest.json").write_text(seal(manifest))
    config = h.hf_config(sglang_ckpt)
    model = served(sglang_ckpt, sglang_store, 0, config)
    r.served_from(model, other)
    error, _ = r.refusal(model, config, entry(hooked=True))
    assert "records routed layout fingerprint xxh3_64:0123456789abcdef" in str(error)
