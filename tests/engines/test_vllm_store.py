"""One store (``convert`` without ``--ep-size``) installed into vLLM's real modules at several EP
sizes, with and without EPLB's redundant experts, MTP layers included: byte-exact against vLLM's
own loading of the source (vLLM 0.33's kernel-layout parameters, 0.30-0.32's finalize contract)."""

from __future__ import annotations

import pytest
import torch
import vllm_harness as h

from megamoe_convert.engines.vllm import install
from megamoe_convert.errors import InstallError, PlacementError
from megamoe_convert.serve import store as store_reader


def build(config, rank, ep_size, redundant):
    return h.build_main_model(config, rank, ep_size, redundant), h.build_mtp_model(config, rank, ep_size, redundant)


def finalize(*models):
    if not h.KERNEL_LAYOUT:  # vLLM 0.30-0.32 finalize in load_weights / process_weights_after_loading
        for moe in (m for model in models for m in model.modules() if isinstance(m, h.model_py.DeepseekV4MoE)):
            moe.finalize_mega_moe_weights()


@pytest.mark.parametrize("ep_size,redundant", [(2, 0), (2, 2), (4, 0), (4, 4), (8, 0), (8, 8)])
def test_one_store_installs_every_rank_of_every_ep_size_as_vllms_own_loading(engine_ckpt, engine_store, ep_size,
                                                                            redundant, monkeypatch):
    config = h.hf_config(engine_ckpt)
    reads = []
    real_fill = store_reader.fill
    monkeypatch.setattr(store_reader, "fill", lambda paths, r, *rest: (reads.append(r), real_fill(paths, r, *rest))[1])
    for rank in range(ep_size):
        with h.patched(rank, ep_size):
            ref_main, ref_mtp = build(config, rank, ep_size, redundant)
            h.vllm_load(ref_main, ref_mtp, engine_ckpt)
            main, mtp = build(config, rank, ep_size, redundant)
            assert install(main, engine_store, rank=rank) == config.num_hidden_layers
            assert install(mtp, engine_store, rank=rank) == config.num_nextn_predict_layers
            finalize(main, mtp)
            want = {**h.experts_of(ref_main), **h.experts_of(ref_mtp)}
            got = {**h.experts_of(main), **h.experts_of(mtp)}
            assert sorted(got) == sorted(want) and len(got) == 3
            for prefix, module in got.items():
                where = f"EP {ep_size}+{redundant} rank {rank} {prefix}"
                h.assert_same_tensors(h.kernel_view(module), h.kernel_view(want[prefix]), where)
                h.assert_same_tensors(module.get_expert_weights(), want[prefix].get_expert_weights(), f"{where} EPLB")
    # vLLM's placement p % n: each tensor of a layer is one read, two where the rank's slots wrap
    per_tensor = [len([r for r in layer_reads if r.key == "l1_weight"])
                  for call in reads for layer_reads in call.values()]
    local = (8 + redundant) // ep_size
    wraps = [(r * local) // 8 != (r * local + local - 1) // 8 for r in range(ep_size)]
    assert sorted(set(per_tensor)) == sorted({1 + w for w in wraps})


def test_a_module_built_for_another_expert_count_is_refused_before_any_module_changes(engine_ckpt, engine_store):
    config = h.hf_config(engine_ckpt)
    with h.patched(1, 4):
        main, _ = build(config, 1, 4, 4)
        target = h.experts_of(main)["model.layers.1.ffn.experts"]
        target.num_logical_experts = 12
        before = {p: [t.clone() for t in m.parameters()] for p, m in h.experts_of(main).items()}
        with pytest.raises(InstallError, match="model.layers.1.ffn.experts: num_logical_experts is 12 in the model "
                                               "but 8"):
            install(main, engine_store, rank=1)
        for prefix, module in h.experts_of(main).items():
            assert all(torch.equal(a, b) for a, b in zip(module.parameters(), before[prefix], strict=True))


def test_a_module_with_fewer_slots_than_experts_is_refused(engine_ckpt, engine_store):
    config = h.hf_config(engine_ckpt)
    with h.patched(0, 2):
        main, _ = build(config, 0, 2, 0)
        target = h.experts_of(main)["model.layers.0.ffn.experts"]
        target.num_experts = 6  # fewer physical slots than the store's 8 logical experts
        with pytest.raises(PlacementError, match=r"model.layers.0.ffn.experts: cannot be served from the store .* "
                                               r"\(layers.0: 8 logical experts\)"):
            install(main, engine_store, rank=0)


@pytest.mark.parametrize("ep_size,redundant,rank", [(2, 2, 1), (8, 8, 6)])
def test_load_format_megamoe_serves_a_store_at_vllms_own_ep_rank(engine_ckpt, engine_store, ep_size, redundant, rank):
    """``--load-format megamoe`` on a store: the rank, EP size and redundant slots are vLLM's own
    (its EP group, its modules), the main model and the MTP draft alike; the rest loads as usual."""
    from test_vllm_load_format import load, megamoe_loader, recording

    config = h.hf_config(engine_ckpt)
    with h.patched(rank, ep_size):
        ref_main, ref_mtp = build(config, rank, ep_size, redundant)
        h.vllm_load(ref_main, ref_mtp, engine_ckpt)
        main, mtp = build(config, rank, ep_size, redundant)
        seen = recording(main)
        recording(mtp)
        load(megamoe_loader(), main, engine_store)
        load(megamoe_loader(), mtp, engine_store)
        want = {**h.experts_of(ref_main), **h.experts_of(ref_mtp)}
        for prefix, module in {**h.experts_of(main), **h.experts_of(mtp)}.items():
            h.assert_same_tensors(h.kernel_view(module), h.kernel_view(want[prefix]), prefix)
    assert seen and not any(".experts." in name and ".shared_experts." not in name for name in seen)
    assert any(name.startswith("layers.0.attn.") for name in seen)
