"""One store installed into SGLang 0.5.23's real modules, the placement read from SGLang's own
expert-location table (an explicit ``--init-expert-location`` one with redundant slots) and its
NextN rule (no expert location, no redundant experts): byte-exact against SGLang's own loading."""

from __future__ import annotations

import json
import types

import pytest
import sglang_harness as h
import torch

from megamoe_convert.engines.sglang import install
from megamoe_convert.errors import PlacementError
from megamoe_convert.serve import store as store_reader

EP_SIZE, REDUNDANT = 4, 4
#: An EPLB-style explicit table, one row per layer with redundant replicas: layer 0 reversed (no two
#: slots of a rank hold consecutive experts: a read per slot), layer 1 with runs to coalesce.
#: (No rank holds an expert twice: SGLang's own loading then fills only the replica it dispatches to.)
TABLE = [[7, 6, 5, 4, 3, 2, 1, 0, 3, 2, 1, 0], [0, 1, 5, 2, 3, 4, 6, 7, 0, 1, 2, 3]]
LAYER1_READS = [2, 1, 2, 1]  # per rank: [0, 1 | 5], [2, 3, 4], [6, 7 | 0], [1, 2, 3]


@pytest.mark.parametrize("rank", range(EP_SIZE))
def test_one_store_installs_sglangs_explicit_expert_location_as_its_own_loading(sglang_ckpt, sglang_store, rank,
                                                                               monkeypatch):
    config = h.hf_config(sglang_ckpt)
    reads = []
    real_fill = store_reader.fill
    monkeypatch.setattr(store_reader, "fill", lambda paths, r, *rest: (reads.append(r), real_fill(paths, r, *rest))[1])
    with h.patched(rank, EP_SIZE, REDUNDANT, init_expert_location=json.dumps({"physical_to_logical_map": TABLE})):
        main, nextn = h.build_main_model(config, rank, REDUNDANT), h.build_nextn_model(config)
        h.sglang_load(main, sglang_ckpt)
        nextn.load_weights(h.checkpoint_weights(sglang_ckpt))
        h.post_process(nextn)
        want = {**h.experts_of(main), **h.experts_of(nextn)}
        main, nextn = h.build_main_model(config, rank, REDUNDANT), h.build_nextn_model(config)
        assert install(main, sglang_store, rank=rank) == config.num_hidden_layers
        assert install(nextn, sglang_store, rank=rank) == 1
        got = {**h.experts_of(main), **h.experts_of(nextn)}
        assert sorted(got) == sorted(want) and len(got) == 3
        for prefix, module in got.items():
            for name, tensor in h.state(module).items():
                h.assert_same_tensor(tensor, h.state(want[prefix])[name], f"rank {rank} {prefix}.{name}")
            h.post_process(torch.nn.ModuleDict({"m": module}))  # SGLang's post-processing now skips its transform
            for name, tensor in h.state(module).items():
                h.assert_same_tensor(tensor, h.state(want[prefix])[name], f"rank {rank} {prefix}.{name} after")
    # reads per tensor: a read per slot in layer 0, runs coalesced in layer 1, NextN (slot p holds p) one
    counts = [{layer.key: len([r for r in layer_reads if r.key == "l1_weight"]) for layer, layer_reads in call.items()}
              for call in reads]
    assert counts == [{"layers.0": 3, "layers.1": LAYER1_READS[rank]}, {"mtp.0": 1}]


def test_a_table_naming_an_expert_the_store_lacks_is_refused_before_any_module_changes(sglang_ckpt, sglang_store):
    config = h.hf_config(sglang_ckpt)
    with h.patched(1, EP_SIZE, REDUNDANT):
        h.build_main_model(config, 1, REDUNDANT)  # built first, as SGLang does: the draft model follows it
        nextn = h.build_nextn_model(config)
        nextn.model.decoder.mlp.experts.num_experts = 12  # 12 slots 0..11 without expert location: no such experts
        before = {p: [t.clone() for t in m.parameters()] for p, m in h.experts_of(nextn).items()}
        with pytest.raises(PlacementError, match=r"model.decoder.mlp.experts: cannot be served from the store .* "
                                               r"logical expert id 8 out of range \[0, 8\)"):
            install(nextn, sglang_store, rank=1)
        for prefix, module in h.experts_of(nextn).items():
            assert not module._mega_moe_weights_built
            assert all(torch.equal(a, b) for a, b in zip(module.parameters(), before[prefix], strict=True))


@pytest.mark.parametrize("rank", [0, 3])
def test_load_format_megamoe_serves_a_store_at_sglangs_own_ep_rank(sglang_ckpt, sglang_store, rank):
    """``--load-format megamoe`` on a store: rank, EP size and placement are SGLang's own (its parallel
    context, its expert-location table), main model and NextN draft alike; the rest loads as usual."""
    from test_sglang_load_format import load, megamoe_loader, recording

    config = h.hf_config(sglang_ckpt)
    with h.patched(rank, EP_SIZE, REDUNDANT, init_expert_location=json.dumps({"physical_to_logical_map": TABLE})):
        ref_main, ref_nextn = h.build_main_model(config, rank, REDUNDANT), h.build_nextn_model(config)
        h.sglang_load(ref_main, sglang_ckpt)
        h.sglang_load(ref_nextn, sglang_ckpt)
        main, nextn = h.build_main_model(config, rank, REDUNDANT), h.build_nextn_model(config)
        seen = recording(main)
        recording(nextn)
        load(megamoe_loader(), main, sglang_store, sglang_ckpt)  # SGLang's post-processing runs here too
        load(megamoe_loader(), nextn, sglang_store, sglang_ckpt)
        want = {**h.experts_of(ref_main), **h.experts_of(ref_nextn)}
        for prefix, module in {**h.experts_of(main), **h.experts_of(nextn)}.items():
            for name, tensor in h.state(module).items():
                h.assert_same_tensor(tensor, h.state(want[prefix])[name], f"{prefix}.{name}")
    assert seen and not any(".experts." in name and ".shared_experts." not in name for name in seen)


def test_a_store_passes_sglangs_own_config_reading_and_serves_through_its_default_loader(sglang_ckpt, sglang_store):
    """``launch_server --model-path STORE``: SGLang's own (hooked) ``get_config`` reads the store's
    config (its manifest's engine is ``any``: the placement is SGLang's, read at install), its
    ``get_model_architecture`` resolves SGLang's own class, and its default loader (``auto``) feeds
    the model's hooked ``load_weights``, which installs the rank's slots from the store: byte-exact
    against SGLang's own loading of the source."""
    from sglang.srt.configs.model_config import ModelImpl
    from sglang.srt.model_loader import utils
    from sglang_model_classes_harness import hooked_load_weights, load, parsed, tree_config

    from megamoe_convert.engines.sglang import model_classes
    from megamoe_convert.output import marker

    config = parsed(sglang_store)
    assert config.architectures == ["DeepseekV4ForCausalLM"]
    assert getattr(config, marker.SECTION)[model_classes.PATH_KEY] == str(sglang_store)
    model_config = types.SimpleNamespace(model_path=str(sglang_store), revision=None, hf_config=config,
                                         hf_text_config=config, quantization=None, is_generation=True,
                                         is_multimodal=False, model_impl=ModelImpl.AUTO)
    assert utils.get_model_architecture(model_config)[0] is h.DeepseekV4ForCausalLM
    seen: list[str] = []
    with h.patched(2, EP_SIZE, REDUNDANT):
        reference = h.build_main_model(h.hf_config(sglang_ckpt), 2, REDUNDANT)
        h.sglang_load(reference, sglang_ckpt)
        tree = tree_config(sglang_ckpt, sglang_store)
        model = h.build_main_model(tree, 2, REDUNDANT)
        with hooked_load_weights(h.DeepseekV4ForCausalLM, seen):
            load("auto", model, sglang_store, tree)
        want = h.experts_of(reference)
        for prefix, module in h.experts_of(model).items():
            for name, tensor in h.state(module).items():
                h.assert_same_tensor(tensor, h.state(want[prefix])[name], f"{prefix}.{name}")
    assert seen and not any(".experts." in n and ".shared_experts." not in n for n in seen)


def test_sglang_refuses_a_store_of_a_family_it_does_not_serve_when_it_reads_the_config(tmp_path):
    """A DeepSeek-V4.1 store: the serving table gives SGLang none of its conversions, and SGLang's
    config hook says so, by the store's manifest, before anything loads."""
    from megamoe_convert.convert.plan import ConvertOptions
    from megamoe_convert.convert.run import convert
    from megamoe_convert.engines.sglang.model_classes import manifest_refusal
    from megamoe_convert.synth.write import synthesize

    synthesize(tmp_path / "ckpt", "v4.1-tiny", seed=3)
    convert(tmp_path / "ckpt", tmp_path / "store", ConvertOptions(ep_size=None, fsync=False))
    assert manifest_refusal(str(tmp_path / "store")) == (
        "a conversion of DeepSeek-V4.1, which SGLang does not serve (SGLang's DeepSeek-V4.1 model is not one "
        "megamoe-convert's SGLang contract is proven against)")
