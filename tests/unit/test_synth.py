"""Synthetic checkpoints: real DeepSeek-V4 names and dtypes, readable by plain safetensors."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli
from safetensors import safe_open

from megamoe_convert.source.checkpoint import Checkpoint
from megamoe_convert.source.formats import FP8_BLOCK
from megamoe_convert.source.model_dims import check_dims
from megamoe_convert.synth.presets import load_preset
from megamoe_convert.synth.write import checkpoint_tensors, synthesize


def read_all(path):
    tensors = {}
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for filename in sorted(set(index["weight_map"].values())):
        with safe_open(path / filename, framework="pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == filename
                tensors[name] = f.get_tensor(name)
    assert set(tensors) == set(index["weight_map"])
    return tensors, index


def test_synth_cli_writes_a_release_shaped_checkpoint(tmp_path):
    out = tmp_path / "ckpt"
    run_cli("synth", out, "--preset", "tiny", "--layers", 3, "--experts", 4, "--seed", 5)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["n_routed_experts"] == 4 and config["expert_dtype"] == "fp4"
    tensors, index = read_all(out)
    h, i = config["hidden_size"], config["moe_intermediate_size"]
    # Original names: no "model." prefix; MTP blocks under mtp.{k}.
    assert not any(n.startswith("model.") for n in tensors)
    assert {"embed.weight", "norm.weight", "head.weight"} <= set(tensors)
    assert "layers.0.ffn.gate.tid2eid" in tensors  # hash-routed first layer
    assert {"layers.2.ffn.gate.weight", "layers.2.ffn.gate.bias"} <= set(tensors)
    assert tensors["layers.1.ffn.shared_experts.w1.weight"].dtype == torch.float8_e4m3fn
    assert tensors["layers.1.ffn.shared_experts.w1.scale"].dtype == torch.float8_e8m0fnu  # vLLM: is_scale_e8m0
    w1 = tensors["layers.2.ffn.experts.3.w1.weight"]
    assert w1.dtype == torch.int8 and tuple(w1.shape) == (i, h // 2)
    s2 = tensors["mtp.0.ffn.experts.1.w2.scale"]
    assert s2.dtype == torch.float8_e8m0fnu and tuple(s2.shape) == (h, i // 32)
    # One layer's experts span several files, as in real releases.
    files_of_layer0 = {index["weight_map"][n] for n in tensors if n.startswith("layers.0.ffn.experts.")}
    assert len(files_of_layer0) >= 2


@pytest.mark.parametrize("weight_dtype,torch_dtype", [("uint8", torch.uint8), ("float4", torch.float4_e2m1fn_x2)])
def test_weight_and_scale_storage_dtypes(tmp_path, weight_dtype, torch_dtype):
    synthesize(tmp_path, "tiny", experts=2, layers=1, mtp_layers=0, weight_dtype=weight_dtype, scale_dtype="uint8")
    tensors, _ = read_all(tmp_path)
    w = tensors["layers.0.ffn.experts.1.w3.weight"]
    assert w.dtype == torch_dtype and w.view(torch.uint8).shape == (128, 128)
    assert tensors["layers.0.ffn.experts.1.w3.scale"].dtype == torch.uint8
    ckpt = Checkpoint.open(tmp_path)
    assert ckpt.expert_entry(ckpt.layers[0], 1, "w3", "weight").byte_shape == (128, 128)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        synthesize(tmp_path / name, "tiny", seed=seed)
    files = sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    assert any((tmp_path / "a" / f).read_bytes() != (tmp_path / "c" / f).read_bytes() for f in files)


#: The released DeepSeek-V4 configs (config.json of deepseek-ai/DeepSeek-V4-Flash and -Pro):
#: hidden, moe_intermediate, routed experts, experts per token, decoder layers, MTP layers.
RELEASED_DIMS = {"flash": (4096, 2048, 256, 6, 43, 1), "pro": (7168, 3072, 384, 6, 61, 1)}


@pytest.mark.parametrize("preset", ["flash", "pro"])
def test_real_presets_have_the_released_dims(preset):
    config = load_preset(preset)
    keys = ("hidden_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
            "num_hidden_layers", "num_nextn_predict_layers")
    assert tuple(config[k] for k in keys) == RELEASED_DIMS[preset]
    assert config["expert_dtype"] == "fp4" and config["model_type"] == "deepseek_v4"
    check_dims(config["hidden_size"], config["moe_intermediate_size"])  # MegaMoE-compatible


def test_synth_refuses_a_non_empty_directory_and_overwrite_replaces_it_whole(tmp_path):
    out = tmp_path / "ckpt"
    run_cli("synth", out, "--shard-mb", "0.1")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    refused = run_cli("synth", out, "--seed", "5", check=False)
    assert refused.returncode == 2 and "not empty" in refused.stderr and "--overwrite" in refused.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    run_cli("synth", out, "--seed", "5", "--overwrite")  # default shard size: fewer, larger shards
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(set(index["weight_map"].values()))
    assert len(index["weight_map"]) and len(list(out.glob("*.safetensors"))) < len([n for n in before if
                                                                                      n.endswith(".safetensors")])
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # nothing hidden left beside it


@pytest.mark.parametrize("preset", ["qwen3-moe", "glm-4.5"])
def test_attention_projections_have_the_heads_an_engine_shards(preset):
    """An engine's model narrows ``q_proj`` into heads x head_dim rows over its tensor-parallel ranks:
    a checkpoint cut to the hidden size would fail (or, on low ranks, silently load short) there."""
    config = load_preset(preset)
    tensors = {t.name: t.shape for t in checkpoint_tensors(config, FP8_BLOCK)
               if t.name.startswith("model.layers.0.self_attn.")}
    h, width = config["hidden_size"], config["num_attention_heads"] * config["head_dim"]
    assert width > h
    assert tensors["model.layers.0.self_attn.q_proj.weight"] == (width, h)
    assert tensors["model.layers.0.self_attn.o_proj.weight"] == (h, width)
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"] == (width // 128, h // 128)
