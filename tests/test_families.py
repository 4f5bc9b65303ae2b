"""Model families on real files through the CLI: Kimi-K3 and DeepSeek-V4.1 checkpoints (``synth``'s
presets with their release's tensor names) detected, inspected, converted and verified with
numerics; what a family cannot be converted to is refused in one line naming what was found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from conftest import run_cli
from megamoe_convert import families
from megamoe_convert.checkpoint import Checkpoint, CheckpointError, MoELayer
from megamoe_convert.loader import load_rank
from megamoe_convert.synth import load_preset


@pytest.fixture(scope="module")
def kimi_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kimi") / "ckpt"
    run_cli("synth", path, "--preset", "kimi-k3-tiny")
    return path


@pytest.fixture(scope="module")
def v41_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("v41") / "ckpt"
    run_cli("synth", path, "--preset", "v4.1-tiny")
    return path


def tensor_names(ckpt: Path) -> set[str]:
    names: set[str] = set()
    for shard in ckpt.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            names.update(f.keys())
    return names


def test_presets_carry_the_published_dims():
    """moonshotai/Kimi-K3 and deepseek-ai/DeepSeek-V4.1-Flash config.json (README "Presets")."""
    kimi = load_preset("kimi-k3")["text_config"]
    assert (kimi["hidden_size"], kimi["routed_expert_hidden_size"], kimi["moe_intermediate_size"]) == (7168, 3584, 3072)
    assert (kimi["num_experts"], kimi["num_experts_per_token"], kimi["num_shared_experts"]) == (896, 16, 2)
    assert (kimi["num_hidden_layers"], kimi["first_k_dense_replace"], kimi["num_nextn_predict_layers"]) == (93, 1, 0)
    v41 = load_preset("v4.1-flash")["text_config"]
    assert (v41["hidden_size"], v41["moe_intermediate_size"], v41["n_routed_experts"]) == (5120, 2304, 384)
    assert (v41["num_hidden_layers"], v41["num_nextn_predict_layers"], v41["dspark_n_routed_experts"]) == (40, 3, 128)


def test_synth_writes_each_familys_real_tensor_names(kimi_ckpt, v41_ckpt):
    kimi = tensor_names(kimi_ckpt)
    assert "language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight_packed" in kimi
    assert "language_model.model.layers.2.block_sparse_moe.experts.0.w1.weight_scale" in kimi
    assert not any(".layers.0.block_sparse_moe." in n for n in kimi)  # first_k_dense_replace = 1
    assert "language_model.model.layers.0.mlp.down_proj.weight" in kimi
    v41 = tensor_names(v41_ckpt)
    assert "layers.1.ffn.experts.7.w3.scale" in v41 and "mtp.0.ffn.experts.3.w1.weight" in v41
    assert "mtp.0.ffn.experts.4.w1.weight" not in v41  # the DSpark draft's own expert count


@pytest.mark.parametrize("fixture,family,title,layers,shared", [
    ("kimi_ckpt", "kimi_k3", "Kimi-K3", ["layers.1", "layers.2"], None),
    ("v41_ckpt", "deepseek_v41", "DeepSeek-V4.1", ["layers.0", "layers.1"], 128),
])
def test_inspect_names_the_family_and_the_weight_format(request, fixture, family, title, layers, shared):
    summary = json.loads(run_cli("inspect", request.getfixturevalue(fixture), "--json").stdout)
    assert (summary["family"], summary["model_family"], summary["weight_format"]) == (family, title, "mxfp4")
    assert summary["moe_layers"] == layers and summary["shared_expert"] == shared
    assert summary["dims"]["hidden_size"] == 256  # Kimi-K3: routed_expert_hidden_size, not hidden_size (512)
    if family == "kimi_k3":
        assert summary["expert_dtypes"] == {f"{p}.{k}": "U8" for p in ("w1", "w3", "w2") for k in ("weight", "scale")}
        assert "mxfp4.py) rebuilds the experts" in summary["engines"]["sglang"]
        assert "outside the MegaMoE launch" in summary["shared_expert_note"]


@pytest.mark.parametrize("fixture,args", [("kimi_ckpt", ()), ("v41_ckpt", ("--num-redundant-experts", 4))])
def test_each_family_converts_and_verifies_with_numerics(request, tmp_path, fixture, args):
    src, out = request.getfixturevalue(fixture), tmp_path / "out"
    run_cli("convert", src, out, "--ep-size", 4, *args)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["family"] == families.detect(json.loads((src / "config.json").read_text()), "x").name
    report = json.loads(run_cli("verify", out, "--source", src, "--numerics", "--json").stdout)
    assert report["ok"] and report["numerics"]["layers"] == 2 * 4, report
    assert report["numerics"]["activation"] == ("situ" if fixture == "kimi_ckpt" else "swiglu")
    assert report["checks"]["non-expert tensors vs source"] > 0
    layer = load_rank(out, 3)["layers.1.ffn.experts"]
    assert list(layer.logical_ids) == ([6, 7] if fixture == "kimi_ckpt" else [1, 2, 3])  # 12 slots: 9 % 8 = 1
    if fixture == "v41_ckpt":  # DSpark's MTP experts are not pre-baked: copied like any other tensor
        index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert "mtp.0.ffn.experts.3.w2.scale" in index and "layers.0.ffn.experts.0.w1.weight" not in index


def test_kimi_k3_conversions_vllm_cannot_serve_are_refused_in_one_line(kimi_ckpt, tmp_path):
    for args, message in ((("--num-redundant-experts", 4), "no redundant or re-placed ones"),
                          (("--engine", "sglang"), "conversions are for vllm only, not sglang (SGLang's Kimi-K3 "
                                                   "MegaMoE path (mxfp4.py) rebuilds the experts")):
        proc = run_cli("convert", kimi_ckpt, tmp_path / "out", "--ep-size", 4, *args, check=False)
        assert proc.returncode != 0 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("change,message", [
    ({"model_type": "kimi_linear"}, r"model_type 'kimi_linear' \(KimiK3ForConditionalGeneration\) is no model family"),
    ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}, r"model_type 'qwen3_moe'"),
])
def test_an_unsupported_model_family_is_refused_naming_what_was_found(kimi_ckpt, tmp_path, change, message):
    config = {**json.loads((kimi_ckpt / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for f in kimi_ckpt.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    with pytest.raises(CheckpointError, match=message):
        Checkpoint.open(tmp_path)
    proc = run_cli("inspect", tmp_path, check=False)
    assert proc.returncode != 0 and "is no model family megamoe-convert converts" in proc.stderr


def test_a_kimi_k3_config_without_the_latent_width_is_refused(kimi_ckpt, tmp_path):
    config = json.loads((kimi_ckpt / "config.json").read_text())
    del config["text_config"]["routed_expert_hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    for f in kimi_ckpt.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    with pytest.raises(CheckpointError, match=r"no text_config.routed_expert_hidden_size: Kimi-K3's MegaMoE experts"):
        Checkpoint.open(tmp_path)


def test_family_names_round_trip():
    """Every family's expert names parse back to the layer, expert, projection and kind they name
    (Kimi-K3's MTP blocks are numbered after the decoder layers)."""
    for family in families.FAMILIES:
        names = family.names(4)
        layers = [MoELayer(False, 2)] + ([MoELayer(True, 1)] if family.prebakes_mtp else [])
        for layer in layers:
            for kind in ("weight", "scale"):
                name = names.expert(layer, 5, "w3", kind)
                assert names.parse_expert(name) == (layer, 5, "w3", kind), name
    assert families.KIMI_K3.names(4).expert(MoELayer(True, 1), 0, "w1", "weight") == \
        "language_model.model.layers.5.block_sparse_moe.experts.0.w1.weight_packed"
    assert families.DEEPSEEK_V41.names(4).parse_expert("mtp.0.ffn.experts.0.w1.weight") is None


def test_kimi_k3_dense_layers_come_from_first_k_dense_replace(kimi_ckpt, tmp_path):
    """The MoE layers are the family's rule on config.json's counts; a config that disagrees with
    the tensors is refused naming the rule and both layer sets."""
    config = json.loads((kimi_ckpt / "config.json").read_text())
    config["text_config"]["first_k_dense_replace"] = 0
    (tmp_path / "config.json").write_text(json.dumps(config))
    for f in kimi_ckpt.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    with pytest.raises(CheckpointError, match=r"text_config.num_hidden_layers=3, text_config.first_k_dense_replace=0, "
                                              r"text_config.moe_layer_freq=1 \(MoE layers 0-2\) but the checkpoint has "
                                              r"experts for decoder layers 1-2"):
        Checkpoint.open(tmp_path)
