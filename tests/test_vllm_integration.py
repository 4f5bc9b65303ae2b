"""`install` and `--load-format megamoe` against stand-ins with vLLM's attribute contract.

``FakeMegaMoEExperts`` mirrors ``DeepseekV4MegaMoEExperts`` (vllm/models/deepseek_v4/nvidia/
model.py): the constructor attributes, the four uint8 loader-side parameters, the early return
of ``finalize_weights`` on ``_transformed_l1_weights``, and the ``get_expert_weights`` EPLB views.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import sys
import types

import pytest
import torch
from torch import nn

from conftest import run_cli
from megamoe_convert import vllm_integration
from megamoe_convert.loader import load_rank
from megamoe_convert.vllm_integration import InstallError, install, layer_key


class FakeMegaMoEExperts(nn.Module):
    def __init__(self, prefix, num_experts, num_local_experts, experts_start_idx, hidden_size, intermediate_size,
                 num_logical_experts=None):
        super().__init__()
        self.prefix = prefix
        self.num_experts = num_experts
        self.num_local_experts = num_local_experts
        self.experts_start_idx = experts_start_idx
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_logical_experts = num_logical_experts or num_experts
        self._transformed_l1_weights = None
        self._transformed_l2_weights = None
        e, h, i = num_local_experts, hidden_size, intermediate_size
        u8 = dict(dtype=torch.uint8, requires_grad=False)
        self.w13_weight = nn.Parameter(torch.zeros(e, 2 * i, h // 2, **u8), requires_grad=False)
        self.w13_weight_scale = nn.Parameter(torch.zeros(e, 2 * i, h // 32, **u8), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.zeros(e, h, i // 2, **u8), requires_grad=False)
        self.w2_weight_scale = nn.Parameter(torch.zeros(e, h, i // 32, **u8), requires_grad=False)

    def finalize_weights(self):
        if self._transformed_l1_weights is not None:
            return
        raise RuntimeError("finalize_weights would transform on an SM100 GPU")

    def get_expert_weights(self):
        self.finalize_weights()
        out = []
        for t in (*self._transformed_l1_weights, *self._transformed_l2_weights):
            if not t.is_contiguous():
                t = t.transpose(1, 2)
                assert t.is_contiguous(), "MN-major scales must be contiguous after transpose(1, 2)"
            out.append(t.view(t.shape[0], -1))
        return out


FakeMegaMoEExperts.__name__ = "DeepseekV4MegaMoEExperts"


def fake_model(rank: int, *, ep_size=4, redundant=4, n_layers=2, hidden=256, inter=128, mtp_prefix="mtp_block"):
    """model.layers.{L}.ffn.experts for decoder layers; MTP at model.layers.{N}.mtp_block.ffn.experts."""
    n_physical = 8 + redundant
    local = n_physical // ep_size

    def experts(prefix):
        return FakeMegaMoEExperts(prefix, n_physical, local, rank * local, hidden, inter, num_logical_experts=8)

    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList()
    for index in range(n_layers + 1):
        block = nn.Module()
        block.ffn = nn.Module()
        prefix = f"model.layers.{index}.ffn.experts"
        if index == n_layers:
            prefix = f"model.layers.{index}.{mtp_prefix}.ffn.experts"
        block.ffn.experts = experts(prefix)
        root.model.layers.append(block)
    return root


def expert_modules(model):
    return [m for m in model.modules() if type(m).__name__ == "DeepseekV4MegaMoEExperts"]


def test_layer_keys_map_vllm_prefixes_to_checkpoint_layers():
    assert layer_key("model.layers.7.ffn.experts", 43) == "layers.7"
    assert layer_key("model.layers.43.mtp_block.ffn.experts", 43) == "mtp.0"
    assert layer_key("model.layers.44.ffn.experts", 43) == "mtp.1"
    assert layer_key("model.mtp.0.ffn.experts", 43) == "mtp.0"
    with pytest.raises(InstallError, match="not a MegaMoE experts prefix"):
        layer_key("model.layers.7.mlp", 43)


@pytest.mark.parametrize("rank", [0, 3])
def test_install_sets_exactly_the_loaded_tensors_and_skips_finalize(tiny_converted, rank):
    model = fake_model(rank)
    assert install(model, tiny_converted, rank=rank) == 3
    expected = load_rank(tiny_converted, rank)
    modules = expert_modules(model)
    for module, key in zip(modules, ["layers.0", "layers.1", "mtp.0"]):
        want = expected[f"{key}.ffn.experts"]
        got_l1, got_l2 = module._transformed_l1_weights, module._transformed_l2_weights
        for got, ref in zip((*got_l1, *got_l2), (*want.l1, *want.l2)):
            assert got.dtype == ref.dtype and got.shape == ref.shape and got.stride() == ref.stride()
            assert torch.equal(got, ref)
        for name in vllm_integration.LOADER_PARAMETERS:
            assert getattr(module, name) is None
        assert not list(module.parameters())
        module.finalize_weights()  # returns at once: nothing left to do
        views = module.get_expert_weights()
        assert [v.shape[0] for v in views] == [3, 3, 3, 3]


@pytest.mark.parametrize("attribute,value,message", [
    ("experts_start_idx", 0, "experts_start_idx is 0 in the model but 3"),
    ("hidden_size", 512, "hidden_size is 512 in the model but 256"),
    ("intermediate_size", 256, "intermediate_size is 256 in the model but 128"),
    ("num_local_experts", 2, "num_local_experts is 2 in the model but 3"),
    ("num_logical_experts", 12, "num_logical_experts is 12 in the model but 8"),
])
def test_mismatch_is_refused_naming_layer_and_values_and_changes_nothing(tiny_converted, attribute, value, message):
    model = fake_model(1)
    target = expert_modules(model)[1]
    setattr(target, attribute, value)
    with pytest.raises(InstallError, match=message) as info:
        install(model, tiny_converted, rank=1)
    assert "model.layers.1.ffn.experts" in str(info.value)
    for module in expert_modules(model):
        assert module._transformed_l1_weights is None and module.w13_weight is not None


def test_model_from_another_ep_size_is_refused(tiny_converted):
    with pytest.raises(InstallError, match=r"num_local_experts is 4 in the model but 3 in .*ep4 \(rank 0, ep_size 4\)"):
        install(fake_model(0, ep_size=2, redundant=0), tiny_converted, rank=0)


def test_rank_none_asks_vllms_ep_group(tiny_converted, monkeypatch):
    group = types.SimpleNamespace(rank_in_group=2)
    distributed = types.ModuleType("vllm.distributed")
    distributed.get_ep_group = lambda: group
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.distributed", distributed)
    model = fake_model(2)
    assert install(model, tiny_converted) == 3
    assert expert_modules(model)[0]._transformed_l1_weights[0].shape[0] == 3


def test_load_format_plugin_registers_and_loads(tiny_ckpt, tiny_converted, tmp_path, monkeypatch):
    """The entry point registers a DefaultModelLoader subclass that installs experts and
    feeds the model every non-expert tensor (stand-in for vllm.model_executor.model_loader)."""
    registry = {}

    class DefaultModelLoader:
        """Like vLLM's: only its own load formats; the repo files it would fetch pass ignore_patterns."""

        def __init__(self, load_config):
            self.load_config = load_config

        def get_all_weights(self, model_config, model):
            if self.load_config.load_format not in ("auto", "hf", "safetensors", "fastsafetensors", "pt"):
                raise ValueError(f"Unknown load_format: {self.load_config.load_format}")
            repo_files = ["model-00001-of-00001.safetensors", "rank-00001-of-00004/layers.0.safetensors"]
            fetched = [f for f in repo_files
                       if not any(fnmatch.fnmatch(f, pattern) for pattern in self.load_config.ignore_patterns)]
            assert fetched == ["model-00001-of-00001.safetensors"]
            yield "model.layers.0.attn.wq_a.weight", torch.zeros(1)
            yield "model.layers.0.ffn.experts.3.w1.weight", torch.zeros(1)
            yield "model.layers.0.ffn.experts.w13_weight", torch.zeros(1)
            yield "model.norm.weight", torch.zeros(1)

    def register_model_loader(name):
        def decorate(cls):
            registry[name] = cls
            return cls
        return decorate

    loader_module = types.ModuleType("vllm.model_executor.model_loader")
    loader_module.DefaultModelLoader = DefaultModelLoader
    loader_module.register_model_loader = register_model_loader
    for name in ("vllm", "vllm.model_executor"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader", loader_module)
    vllm_integration.register()
    load_config = types.SimpleNamespace(load_format="megamoe", ignore_patterns=["original/**/*"])
    loader = registry["megamoe"](load_config=load_config)
    assert load_config.load_format == "megamoe"  # vLLM's own config object is left as it was
    assert loader.load_config.ignore_patterns == ["original/**/*", vllm_integration.RANK_FILES_PATTERN]

    model = fake_model(1)
    seen = []
    model.load_weights = lambda weights: seen.extend(name for name, _ in weights)
    ep = types.SimpleNamespace(rank_in_group=1)
    monkeypatch.setitem(sys.modules, "vllm.distributed", types.SimpleNamespace(get_ep_group=lambda: ep))
    loader.load_weights(model, types.SimpleNamespace(model=str(tiny_converted)))
    assert seen == ["model.layers.0.attn.wq_a.weight", "model.norm.weight"]
    assert all(m._transformed_l1_weights is not None for m in expert_modules(model))

    experts_only = tmp_path / "experts-only"
    run_cli("convert", tiny_ckpt, experts_only, "--ep-size", 4, "--num-redundant-experts", 4, "--experts-only")
    with pytest.raises(InstallError, match="converted with --experts-only"):
        loader.load_weights(fake_model(1), types.SimpleNamespace(model=str(experts_only)))


def test_entry_point_is_declared():
    text = (__import__("pathlib").Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert '[project.entry-points."vllm.general_plugins"]' in text
    assert 'megamoe = "megamoe_convert.vllm_integration:register"' in text


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_real_vllm_registers_the_load_format():
    vllm_integration.register()
    from vllm.model_executor.model_loader import get_model_loader  # noqa: F401
    from vllm.config import LoadConfig
    loader = get_model_loader(LoadConfig(load_format="megamoe"))
    assert type(loader).__name__ == "MegaMoEModelLoader"
    assert loader.load_config.load_format == "safetensors"  # the default loader underneath knows this one


def test_explicit_placement_is_refused_because_vllm_maps_slots_by_modulo(tiny_ckpt, tmp_path):
    """vLLM's MegaMoE path assumes slot p holds expert p % n: a permuted placement would route
    tokens to the wrong experts, so install refuses it instead of serving wrong answers."""
    (tmp_path / "eplb.json").write_text(json.dumps([3, 2, 1, 0, 7, 6, 5, 4, 0, 1, 2, 3]))
    out = tmp_path / "eplb"
    run_cli("convert", tiny_ckpt, out, "--ep-size", 4, "--placement", tmp_path / "eplb.json", "--experts-only")
    model = fake_model(1)
    with pytest.raises(InstallError, match="explicit expert placement"):
        install(model, out, rank=1)
    assert all(m._transformed_l1_weights is None for m in expert_modules(model))
