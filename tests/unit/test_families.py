"""Model families on real files through the CLI: Kimi-K3 and DeepSeek-V4.1 checkpoints (``synth``'s
presets with their release's tensor names) detected, inspected, converted and verified with
numerics; what a family cannot be converted to is refused in one line naming what was found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli
from safetensors import safe_open

from megamoe_convert.convert.plan import ConvertOptions
from megamoe_convert.convert.run import convert
from megamoe_convert.errors import MegamoeError
from megamoe_convert.layout.placement import PlacementError
from megamoe_convert.serve.loader import load_rank
from megamoe_convert.source import families
from megamoe_convert.source.checkpoint import Checkpoint, CheckpointError
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.synth.presets import load_preset


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
    ("v41_ckpt", "deepseek_v41", "DeepSeek-V4.1", ["layers.0", "layers.1", "mtp.0"], 128),
])
def test_inspect_names_the_family_and_the_weight_format(request, fixture, family, title, layers, shared):
    summary = json.loads(run_cli("inspect", request.getfixturevalue(fixture), "--json").stdout)
    assert (summary["family"], summary["model_family"], summary["weight_format"]) == (family, title, "mxfp4")
    assert summary["moe_layers"] == layers and summary["shared_intermediate_size"] == (shared or 0)
    assert summary["shared_expert_prebaked"] is bool(shared)
    assert summary["dims"]["hidden_size"] == 256  # Kimi-K3: routed_expert_hidden_size, not hidden_size (512)
    assert summary["dims"]["mtp_n_routed_experts"] == (4 if family == "deepseek_v41" else 0)  # DSpark's own count
    if family == "kimi_k3":
        assert summary["expert_dtypes"] == {f"{p}.{k}": "U8" for p in ("w1", "w3", "w2") for k in ("weight", "scale")}
        assert summary["engines"]["sglang"]["supported"] is False
        assert "mxfp4.py) rebuilds the experts" in summary["engines"]["sglang"]["reason"]
        assert "outside the MegaMoE launch" in summary["shared_expert_note"]


@pytest.mark.parametrize("fixture,args", [("kimi_ckpt", ()), ("v41_ckpt", ("--num-redundant-experts", 4))])
def test_each_family_converts_and_verifies_with_numerics(request, tmp_path, fixture, args):
    src, out = request.getfixturevalue(fixture), tmp_path / "out"
    run_cli("convert", src, out, "--ep-size", 4, *args)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["family"] == families.detect(json.loads((src / "config.json").read_text()), "x").name
    report = json.loads(run_cli("verify", out, "--source", src, "--numerics", "--json").stdout)
    layers = 2 + (fixture == "v41_ckpt")  # V4.1: its DSpark MTP layer too
    # every MoE layer at least once, each of the 4 ranks at least once (the ranks take turns)
    assert report["ok"] and report["numerics"]["layers"] == max(layers, 4), report
    assert report["numerics"]["activation"] == ("situ" if fixture == "kimi_ckpt" else "swiglu")
    assert report["checks"]["non_expert_tensors_vs_source"] > 0
    layer = load_rank(out, 3)["layers.1.ffn.experts"]
    assert list(layer.logical_ids) == ([6, 7] if fixture == "kimi_ckpt" else [1, 2, 3])  # 12 slots: 9 % 8 = 1
    if fixture == "v41_ckpt":  # DSpark's MTP layer: its own 4 experts + the 4 redundant slots, 2 per rank
        index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert not [n for n in index if ".experts." in n and ".shared_experts." not in n]
        assert manifest["dims"]["mtp_n_routed_experts"] == 4
        assert [list(load_rank(out, r)["mtp.0.ffn.experts"].logical_ids) for r in range(4)] == [[0, 1], [2, 3],
                                                                                              [0, 1], [2, 3]]


def test_kimi_k3_conversions_vllm_cannot_serve_are_refused_in_one_line(kimi_ckpt, tmp_path):
    for args, message in ((("--num-redundant-experts", 4), "no redundant or re-placed ones"),
                          (("--engine", "sglang"), "conversions are for vllm only, not sglang (SGLang's Kimi-K3 "
                                                   "MegaMoE path (mxfp4.py) rebuilds the experts")):
        proc = run_cli("convert", kimi_ckpt, tmp_path / "out", "--ep-size", 4, *args, check=False)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("change,message", [
    ({"model_type": "kimi_linear"}, r"model_type 'kimi_linear' \(KimiK3ForConditionalGeneration\) is no model family"),
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}, r"model_type 'mixtral'"),
])
def test_an_unsupported_model_family_is_refused_naming_what_was_found(kimi_ckpt, tmp_path, change, message):
    config = {**json.loads((kimi_ckpt / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for f in kimi_ckpt.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    with pytest.raises(MegamoeError, match=message):
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
        layers = [MoELayer(False, 2), MoELayer(True, 1)]
        for layer in layers:
            for kind in ("weight", "scale"):
                name = names.expert(layer, 5, "w3", kind)
                assert names.parse_expert(name) == (layer, 5, "w3", kind), name
    assert families.KIMI_K3.names(4).expert(MoELayer(True, 1), 0, "w1", "weight") == \
        "language_model.model.layers.5.block_sparse_moe.experts.0.w1.weight_packed"
    assert families.DEEPSEEK_V41.names(4).parse_expert("mtp.0.ffn.experts.0.w1.weight") == \
        (MoELayer(True, 0), 0, "w1", "weight")


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


def test_deepseek_v41_dspark_layers_vllm_would_not_build_are_refused_in_one_line(v41_ckpt, tmp_path):
    """vLLM builds DSpark's MTP layers with their own 4 experts and the decoder's redundant count:
    an EP size that does not divide them (its own assertion), or an explicit placement of the
    decoder's 8 experts, is refused; leaving the MTP layer out converts."""
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps([7, 6, 5, 4, 3, 2, 1, 0]))
    for args, message in ((("--ep-size", 8), "mtp.0 (4 experts): vLLM builds the layers with 4 experts of their own "
                                             "with 0 redundant ones: 4 physical experts are not divisible by "
                                             "ep_size=8; "
                                             "EP sizes that work for every selected MoE layer: 1, 2, 4; or leave mtp.0 "
                                             "out: --layers 0-1"),
                          (("--ep-size", 4, "--placement", placement),
                           "vLLM serves MegaMoE experts only in its default placement")):
        proc = run_cli("convert", v41_ckpt, tmp_path / "out", *args, check=False)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for command in ("plan", "inspect"):  # the same refusal before any conversion
        proc = run_cli(command, v41_ckpt, "--ep-size", 8, check=False)
        assert proc.returncode == 2 and "mtp.0 (4 experts)" in proc.stderr and "--layers 0-1" in proc.stderr
    assert json.loads(run_cli("inspect", v41_ckpt, "--json").stdout)["working_ep_sizes"]["vllm"] == [1, 2, 4]
    with pytest.raises(PlacementError, match=r"mtp.0 \(4 experts\): an explicit placement lists the decoder layers' "
                                             "8 experts"):  # the layer's own rule, below the serving check
        convert(v41_ckpt, tmp_path / "lib", ConvertOptions(4, placement_file=placement, check_serving=False))
    run_cli("convert", v41_ckpt, tmp_path / "out", "--ep-size", 8, "--layers", "0-1", "--experts-only")
    assert [layer["key"] for layer in json.loads((tmp_path / "out" / "manifest.json").read_text())["layers"]] == \
        ["layers.0", "layers.1"]


def test_a_manifest_whose_dspark_count_vllm_could_not_place_is_refused(v41_ckpt, tmp_path):
    """The manifest's ``dims.mtp_n_routed_experts`` fixes the MTP layer's placement and file sizes:
    a count that does not divide over the EP size is a manifest problem, not a crash."""
    from megamoe_convert.errors import ManifestError
    from megamoe_convert.output.manifest import read_manifest
    from megamoe_convert.output.seal import seal

    out = tmp_path / "out"
    run_cli("convert", v41_ckpt, out, "--ep-size", 4, "--layers", "mtp", "--experts-only")
    assert [layer.key for layer in read_manifest(out).layers] == ["mtp.0"]
    data = json.loads((out / "manifest.json").read_text())
    data["dims"]["mtp_n_routed_experts"] = 3
    (out / "manifest.json").write_text(seal({k: v for k, v in data.items() if k != "manifest_checksum"}))
    with pytest.raises(ManifestError, match=r"dims\.mtp_n_routed_experts: vLLM builds the layers with 3 experts of "
                                            r"their own with 0 redundant ones"):
        read_manifest(out)
