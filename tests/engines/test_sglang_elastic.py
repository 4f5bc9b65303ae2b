"""A rank joining a running SGLang 0.5.23 deployment (``--elastic-ep-join-mode scale``) takes its
experts from a store: SGLang's own topology for the joiner (its join offset, its initial EP size,
its expert-location table of the grown world), its slots read from the store alone, byte-exact
against SGLang's own joiner load (the whole checkpoint read and transformed)."""

from __future__ import annotations

import pytest
import sglang_harness as h
import torch

from megamoe_convert.engines.sglang import install
from megamoe_convert.errors import MegamoeError
from megamoe_convert.serve import store as store_reader

EP_SIZE, REDUNDANT, OFFSET = 4, 4, 4
#: Four ranks join four serving ones: EP 8, each joiner's slots at its join offset plus its rank.
JOIN = dict(elastic_ep_backend="mooncake", ep_join_mode="scale", node_rank=1, nnodes=2, ep_join_rank_offset=OFFSET,
            max_ep_size=EP_SIZE + OFFSET, elastic_ep_initial_size=EP_SIZE)


def joiner(config, rank):
    """Joiner ``rank`` of its group (world rank ``OFFSET + rank``), as SGLang builds it."""
    return h.build_main_model(config, OFFSET + rank, REDUNDANT)


@pytest.mark.parametrize("rank", range(EP_SIZE))
def test_a_joining_rank_takes_its_slots_from_the_store_as_sglangs_own_joiner_load(sglang_ckpt, sglang_store, rank,
                                                                                  monkeypatch):
    config = h.hf_config(sglang_ckpt)
    reads = []
    real_fill = store_reader.fill
    monkeypatch.setattr(store_reader, "fill", lambda paths, r, *rest: (reads.append(r), real_fill(paths, r, *rest))[1])
    with h.patched(OFFSET + rank, EP_SIZE, REDUNDANT, **JOIN):
        reference = joiner(config, rank)
        h.sglang_load(reference, sglang_ckpt)  # SGLang's joiner: every expert tensor read, its slots transformed
        model = joiner(config, rank)
        assert install(model, sglang_store) == config.num_hidden_layers  # rank: SGLang's own, the grown world's
        want = h.experts_of(reference)
        for prefix, module in h.experts_of(model).items():
            assert module.moe_ep_rank == rank and module._expert_storage_rank == OFFSET + rank
            for name, tensor in h.state(module).items():
                h.assert_same_tensor(tensor, h.state(want[prefix])[name], f"joiner {rank} {prefix}.{name}")
    [call] = reads
    read = sorted(sum(r.nbytes for r in layer_reads if r.key == "l1_weight") for layer_reads in call.values())
    assert read == sorted(3 * m.w13_weight[0].nbytes for m in h.experts_of(model).values())  # its 3 slots alone


def test_load_format_megamoe_serves_a_joiner_from_the_store(sglang_ckpt, sglang_store):
    """``--load-format megamoe`` in the joining process: SGLang's loader, the rank from its own context."""
    from test_sglang_load_format import load, megamoe_loader, recording

    config = h.hf_config(sglang_ckpt)
    with h.patched(OFFSET + 1, EP_SIZE, REDUNDANT, **JOIN):
        reference = joiner(config, 1)
        h.sglang_load(reference, sglang_ckpt)
        model = joiner(config, 1)
        seen = recording(model)  # the tree holds only the MoE layers: the rest is recorded, not loaded
        load(megamoe_loader(), model, sglang_store, sglang_ckpt)
        want = h.experts_of(reference)
        for prefix, module in h.experts_of(model).items():
            for name, tensor in h.state(module).items():
                h.assert_same_tensor(tensor, h.state(want[prefix])[name], f"{prefix}.{name}")
    assert seen and not any(".experts." in name and ".shared_experts." not in name for name in seen)


def test_a_joiner_refuses_a_per_rank_conversion_of_the_old_ep_size(sglang_ckpt, sglang_converted):
    """Per-rank files of EP 4 hold no slot of the grown world's rank 5: refused before any module changes."""
    config = h.hf_config(sglang_ckpt)
    with h.patched(OFFSET + 1, EP_SIZE, REDUNDANT, **JOIN):
        model = joiner(config, 1)
        before = {p: [t.clone() for t in m.parameters()] for p, m in h.experts_of(model).items()}
        with pytest.raises(MegamoeError, match="rank 5"):
            install(model, sglang_converted)
        for prefix, module in h.experts_of(model).items():
            assert all(torch.equal(a, b) for a, b in zip(module.parameters(), before[prefix], strict=True))
