"""DeepSeek-V3/R1, Qwen3-MoE and GLM-4.5 on real files through the CLI: ``synth`` writes their FP8
releases' names and dtypes, ``inspect`` names the family, ``convert --engine sglang`` writes SGLang's
SM90 FP8 MegaMoE layout (``docs/megamoe-layout.md``, "SM90") byte for byte, ``verify --numerics``
runs the FP8 MoE reference, and what no engine serves is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from safetensors import safe_open

from megamoe_convert.layout import inverse, sm90
from megamoe_convert.serve.loader import load_rank
from megamoe_convert.source import families, formats
from megamoe_convert.source.checkpoint import Checkpoint
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.synth.presets import load_preset

#: preset -> (family, decoder MoE layers, MTP layers) of the tiny presets.
TINY = {"deepseek-v3-tiny": (families.DEEPSEEK_V3, [1, 2], 1), "qwen3-moe-tiny": (families.QWEN3_MOE, [0, 1], 0),
        "glm-4.5-tiny": (families.GLM4_MOE, [1, 2], 1)}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8-families")
    for preset in TINY:
        run_cli("synth", root / preset, "--preset", preset, "--seed", 3)
    return {preset: root / preset for preset in TINY}


def tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def test_presets_carry_the_published_dims():
    """deepseek-ai/DeepSeek-V3, Qwen/Qwen3-235B-A22B-FP8 and zai-org/GLM-4.5 config.json (README "Presets")."""
    v3 = load_preset("deepseek-v3")
    assert (v3["hidden_size"], v3["moe_intermediate_size"], v3["n_routed_experts"], v3["num_experts_per_tok"]) == \
        (7168, 2048, 256, 8)
    assert (v3["num_hidden_layers"], v3["first_k_dense_replace"], v3["num_nextn_predict_layers"]) == (61, 3, 1)
    qwen = load_preset("qwen3-moe")
    assert (qwen["hidden_size"], qwen["moe_intermediate_size"], qwen["num_experts"], qwen["num_experts_per_tok"]) == \
        (4096, 1536, 128, 8)
    assert (qwen["num_hidden_layers"], qwen["decoder_sparse_step"], qwen["mlp_only_layers"]) == (94, 1, [])
    glm = load_preset("glm-4.5")
    assert (glm["hidden_size"], glm["moe_intermediate_size"], glm["n_routed_experts"], glm["num_experts_per_tok"]) == \
        (5120, 1536, 160, 8)
    assert (glm["num_hidden_layers"], glm["first_k_dense_replace"], glm["num_nextn_predict_layers"]) == (92, 3, 1)
    for config in (v3, qwen, glm):
        assert config["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                                 "weight_block_size": [128, 128]}


def test_synth_writes_each_familys_fp8_release_names(ckpts):
    v3 = tensors(ckpts["deepseek-v3-tiny"])
    gate = v3["model.layers.1.mlp.experts.7.gate_proj.weight"]
    scale = v3["model.layers.1.mlp.experts.7.gate_proj.weight_scale_inv"]
    assert (gate.dtype, tuple(gate.shape), scale.dtype, tuple(scale.shape)) == \
        (torch.float8_e4m3fn, (256, 512), torch.float32, (2, 4))
    assert tuple(v3["model.layers.3.mlp.experts.0.down_proj.weight"].shape) == (512, 256)  # the MTP layer
    assert "model.layers.3.eh_proj.weight" in v3 and "model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv" in v3
    assert not any(n.startswith("model.layers.0.mlp.experts.") for n in v3)  # first_k_dense_replace
    assert "model.layers.0.mlp.gate_proj.weight" in v3
    qwen = tensors(ckpts["qwen3-moe-tiny"])
    assert "model.layers.0.mlp.experts.7.up_proj.weight_scale_inv" in qwen
    assert not any("shared_experts" in n or "layers.2." in n for n in qwen)
    glm = tensors(ckpts["glm-4.5-tiny"])
    assert "model.layers.3.mlp.experts.7.gate_proj.weight" in glm and "model.layers.3.enorm.weight" in glm
    assert (scale > 0).all() and torch.isfinite(scale).all()


@pytest.mark.parametrize("preset", TINY)
def test_inspect_names_the_family_and_its_layers(ckpts, preset):
    family, decoder, mtp = TINY[preset]
    ckpt = Checkpoint.open(ckpts[preset])
    assert ckpt.family is family and ckpt.dims.weight_format == "fp8_block"
    assert [layer.key for layer in ckpt.layers] == [f"layers.{i}" for i in decoder] + [f"mtp.{k}" for k in range(mtp)]
    shown = json.loads(run_cli("inspect", ckpts[preset], "--json").stdout)
    assert json.dumps(shown).count(family.name) >= 1 and "fp8_block" in json.dumps(shown)


def test_the_sm90_layout_interleaves_only_the_l1_weight():
    """sm90.sm90_transform_experts against the spec written out by hand, on random bytes."""
    e, h, i = 2, 256, 128
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randint(0, 256, (e, 2 * i, h), dtype=torch.uint8, generator=gen)
    s13 = torch.rand((e, 2 * i // 128, h // 128), generator=gen)
    w2 = torch.randint(0, 256, (e, h, i), dtype=torch.uint8, generator=gen)
    s2 = torch.rand((e, h // 128, i // 128), generator=gen)
    l1, l2 = sm90.sm90_transform_experts(w13.view(torch.float8_e4m3fn), s13, w2.view(torch.float8_e4m3fn), s2)
    for b in range(i // 8):
        for j in range(8):
            assert torch.equal(l1.weight.view(torch.uint8)[:, 16 * b + j], w13[:, 8 * b + j])
            assert torch.equal(l1.weight.view(torch.uint8)[:, 16 * b + 8 + j], w13[:, i + 8 * b + j])
    assert l1.weight.dtype == torch.float8_e4m3fn and l1.weight.is_contiguous()
    assert torch.equal(l1.sf, s13) and torch.equal(l2.weight.view(torch.uint8), w2) and torch.equal(l2.sf, s2)
    back = inverse.sm90_inverse_transform_experts(l1, l2)
    assert all(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
               for a, b in zip(back, (w13, s13, w2, s2), strict=True))


@pytest.fixture(scope="module")
def v3_converted(ckpts, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("v3-out") / "ep4"
    run_cli("convert", ckpts["deepseek-v3-tiny"], out, "--ep-size", 4, "--num-redundant-experts", 4,
            "--engine", "sglang")
    return out


def test_rank_files_hold_what_sglangs_sm90_build_leaves(ckpts, v3_converted):
    """Every rank's every layer against the checkpoint's tensors, laid out by the spec by hand: the L1
    weight gate/up-interleaved 8 by 8, its FP32 block scales the gate's then the up's, L2 as is; the
    MTP layer placed like a decoder layer (redundant slots included), as SGLang's DeepseekV2MoE builds it."""
    src = tensors(ckpts["deepseek-v3-tiny"])
    manifest = json.loads((v3_converted / "manifest.json").read_text())
    assert manifest["family"] == "deepseek_v3" and manifest["dims"]["weight_format"] == "fp8_block"
    for rank in range(4):
        loaded = load_rank(v3_converted, rank)
        for key in ("layers.1", "layers.2", "mtp.0"):
            layer = loaded[MoELayer.parse(key).prefix]
            index = 3 if key == "mtp.0" else int(key.split(".")[1])
            ids = [(3 * rank + s) % 8 for s in range(3)]  # 12 physical slots over 8 logical experts
            assert list(layer.logical_ids) == ids
            for slot, lid in enumerate(ids):
                p = f"model.layers.{index}.mlp.experts.{lid}"
                gate, up = src[f"{p}.gate_proj.weight"].view(torch.uint8), src[f"{p}.up_proj.weight"].view(torch.uint8)
                want = torch.stack([gate.reshape(-1, 8, 512), up.reshape(-1, 8, 512)], 1).reshape(512, 512)
                assert torch.equal(layer.l1.weight[slot].view(torch.uint8), want)
                assert torch.equal(layer.l1.sf[slot], torch.cat([src[f"{p}.gate_proj.weight_scale_inv"],
                                                                  src[f"{p}.up_proj.weight_scale_inv"]]))
                assert torch.equal(layer.l2.weight[slot].view(torch.uint8),
                                   src[f"{p}.down_proj.weight"].view(torch.uint8))
                assert torch.equal(layer.l2.sf[slot], src[f"{p}.down_proj.weight_scale_inv"])
            assert layer.l1.sf.dtype == torch.float32 and layer.l1.sf.is_contiguous()


def test_verify_runs_the_fp8_moe_reference_and_catches_one_changed_byte(ckpts, v3_converted, tmp_path):
    done = run_cli("verify", v3_converted, "--source", ckpts["deepseek-v3-tiny"], "--numerics", "--numerics-every-rank",
                   "--json")
    report = json.loads(done.stdout)
    assert report["ok"] and report["problems"] == []
    numerics = report["numerics"]
    assert (numerics["weight_format"], numerics["activation"], numerics["max_abs_err"], numerics["layers"]) == \
        ("fp8_block", "swiglu", 0.0, 12)  # 4 ranks x (2 decoder layers + the MTP layer)
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(v3_converted, broken)
    rank_file = broken / "rank-00001-of-00004" / "layers.2.safetensors"
    data = bytearray(rank_file.read_bytes())
    data[-200] ^= 0x01  # a byte of the L2 block scales, the last tensors before the logical ids
    rank_file.write_bytes(bytes(data))
    failed = run_cli("verify", broken, "--source", ckpts["deepseek-v3-tiny"], "--numerics", check=False)
    assert failed.returncode != 0 and "layers.2" in failed.stdout + failed.stderr


@pytest.mark.parametrize("preset,args,message", [
    ("deepseek-v3-tiny", ["--ep-size", 4, "--engine", "vllm"],
     r"DeepSeek-V3 conversions are for sglang only, not vllm \(vLLM 0.30-0.33 runs MegaMoE for DeepSeek-V4, "
     r"DeepSeek-V4.1 and Kimi-K3 only\); drop --engine vllm: DeepSeek-V3 defaults to sglang"),
    ("qwen3-moe-tiny", ["--ep-size", 2, "--engine", "vllm"], "Qwen3-MoE conversions are for sglang only, not vllm"),
    ("glm-4.5-tiny", ["--ep-size", 2, "--engine", "sglang"],
     r"GLM-4.5 checkpoints are read \(inspect, plan\) but not converted: no engine runs GLM-4.5's MegaMoE yet: "
     r"vLLM 0.30-0.33 runs MegaMoE for .* only; SGLang 0.5.23's Glm4MoeSparseMoeBlock never takes the MegaMoE "
     "forward"),
    ("glm-4.5-tiny", [], r"GLM-4.5 checkpoints are read \(inspect, plan\) but not converted"),
])
def test_what_no_engine_serves_is_refused_in_one_line(ckpts, tmp_path, preset, args, message):
    done = run_cli("convert", ckpts[preset], tmp_path / "out", *args, check=False)
    assert done.returncode != 0
    line = [row for row in done.stderr.splitlines() if row.strip()]
    assert len(line) == 1, done.stderr
    assert __import__("re").search(message, line[0]), line[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args", [["--ep-size", 2, "--engine", "sglang"], []])
def test_qwen3_moe_converts_per_rank_and_as_a_store_and_verifies_with_numerics(ckpts, tmp_path, args):
    run_cli("convert", ckpts["qwen3-moe-tiny"], tmp_path / "out", *args)
    report = json.loads(run_cli("verify", tmp_path / "out", "--source", ckpts["qwen3-moe-tiny"], "--numerics",
                                "--json").stdout)
    assert report["ok"], report


def test_a_scale_dtype_the_format_does_not_store_is_refused(tmp_path):
    done = run_cli("synth", tmp_path / "ckpt", "--preset", "deepseek-v3-tiny", "--scale-dtype", "e8m0", check=False)
    assert done.returncode != 0 and "--scale-dtype e8m0: fp8_block experts' scales are stored as float32, bfloat16, " \
        "float16" in done.stderr and not (tmp_path / "ckpt").exists()


def test_fp8_block_dequantises_each_128x128_block_with_its_fp32_scale():
    fmt = formats.FP8_BLOCK
    weight = torch.full((256, 384), 2.0).to(torch.float8_e4m3fn)
    scale = torch.arange(1, 7, dtype=torch.float32).reshape(2, 3)
    values = formats.dequantize(fmt, weight.view(torch.uint8), scale.view(torch.uint8))
    assert values[0, 0] == 2.0 and values[127, 383] == 6.0 and values[128, 0] == 8.0 and values[255, 383] == 12.0


@pytest.mark.parametrize("scale_dtype,torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_block_scales_stored_in_16_bits_are_widened_to_fp32_as_sglang_loads_them(tmp_path, scale_dtype, torch_dtype):
    """Some FP8 releases (Qwen3's among them) store ``weight_scale_inv`` in 16 bits; SGLang's weight_loader
    copies them into its FP32 parameters, so the rank files hold the exact FP32 widening."""
    run_cli("synth", tmp_path / "ckpt", "--preset", "qwen3-moe-tiny", "--scale-dtype", scale_dtype, "--seed", 5)
    src = tensors(tmp_path / "ckpt")
    assert src["model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"].dtype == torch_dtype
    run_cli("convert", tmp_path / "ckpt", tmp_path / "out", "--ep-size", 2, "--engine", "sglang")
    layer = load_rank(tmp_path / "out", 0)[MoELayer.parse("layers.1").prefix]
    p = "model.layers.1.mlp.experts.2"
    assert torch.equal(layer.l1.sf[2], torch.cat([src[f"{p}.gate_proj.weight_scale_inv"],
                                                  src[f"{p}.up_proj.weight_scale_inv"]]).float())
    assert layer.l2.sf.dtype == torch.float32
    assert torch.equal(layer.l2.sf[2], src[f"{p}.down_proj.weight_scale_inv"].float())
    report = json.loads(run_cli("verify", tmp_path / "out", "--source", tmp_path / "ckpt", "--numerics",
                                "--json").stdout)
    assert report["ok"] and report["numerics"]["max_abs_err"] == 0.0


def test_the_serve_command_turns_off_sglangs_shared_expert_fusion_where_it_is_on_by_default(ckpts, v3_converted,
                                                                                            tmp_path):
    """SGLang fuses DeepSeek-V3's shared expert into the routed experts by default; the pre-baked slots
    hold the routed experts only, so the command ``inspect`` prints asks for it off (Qwen3-MoE has none)."""
    v3 = json.loads(run_cli("inspect", v3_converted, "--json").stdout)
    assert "--disable-shared-experts-fusion" in v3["serve"]["sglang"]["command"], v3["serve"]
    run_cli("convert", ckpts["qwen3-moe-tiny"], tmp_path / "qwen", "--ep-size", 2, "--engine", "sglang")
    qwen = json.loads(run_cli("inspect", tmp_path / "qwen", "--json").stdout)
    assert qwen["serve"]["sglang"]["command"] and "fusion" not in qwen["serve"]["sglang"]["command"]


@pytest.fixture(scope="module")
def v3_store(ckpts, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("v3-store") / "store"
    run_cli("convert", ckpts["deepseek-v3-tiny"], out)
    return out


def test_the_fp8_families_convert_for_sglang_without_naming_it(ckpts, v3_converted, tmp_path):
    """SGLang is the only engine that serves them: ``convert`` makes its placement by default, and the
    bytes are those of ``--engine sglang``."""
    run_cli("convert", ckpts["deepseek-v3-tiny"], tmp_path / "out", "--ep-size", 4, "--num-redundant-experts", 4)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["engine"] == "sglang"
    for rank in (0, 3):
        got, want = load_rank(tmp_path / "out", rank), load_rank(v3_converted, rank)
        for prefix, layer in want.items():
            assert got[prefix].logical_ids == layer.logical_ids
            assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                       for a, b in zip(got[prefix].tensors.values(), layer.tensors.values(), strict=True))


def test_a_store_of_an_fp8_family_is_served_end_to_end(v3_store, v3_converted):
    """Every step the store's ``inspect`` suggests works: its EP sizes, what each rank reads, its plan,
    and ``load_rank(store, rank, ep_size=N)`` under SGLang's placement, equal to the per-rank files."""
    info = json.loads(run_cli("inspect", v3_store, "--json").stdout)
    assert info["serve"]["sglang"]["servable"] and info["serve"]["sglang"]["ep_sizes"] == [1, 2, 4, 8]
    assert "SGLang 0.5.23 on Hopper" in info["serve"]["sglang"]["notes"]
    assert "--disable-shared-experts-fusion" in info["serve"]["sglang"]["command"]
    assert not info["serve"]["vllm"]["servable"] and info["serve"]["vllm"]["reason"].startswith("vLLM 0.30-0.33 runs")
    reads = json.loads(run_cli("inspect", v3_store, "--ep-size", 4, "--num-redundant-experts", 4, "--json").stdout)
    assert reads["reads"]["engine"] == "sglang" and len(reads["reads"]["ranks"]) == 4
    plan = json.loads(run_cli("plan", v3_store, "--ep-size", 4, "--json").stdout)
    assert plan["engine"] == "sglang" and [r["rank"] for r in plan["ranks"]] == [0, 1, 2, 3]
    sizes = json.loads(run_cli("plan", v3_store, "--json").stdout)
    assert sizes["working_ep_sizes"] == {"sglang": [1, 2, 4, 8]}
    for rank in range(4):
        from_store = load_rank(v3_store, rank, ep_size=4)
        assert [list(layer.logical_ids) for layer in from_store.values()] == [[2 * rank, 2 * rank + 1]] * 3
    from megamoe_convert import load_slots
    from megamoe_convert.serve.loader import open_converted

    per_rank = load_rank(v3_converted, 1)  # EP 4 with 4 redundant: the slots' experts, read from the store
    slots = load_slots(open_converted(v3_store), {MoELayer.parse(layer.key): layer.logical_ids
                                                  for layer in per_rank.values()})
    for prefix, layer in per_rank.items():
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip(slots[prefix].tensors.values(), layer.tensors.values(), strict=True))


def test_an_ep_size_a_store_cannot_take_is_refused_with_those_it_can(v3_store):
    for command in ("inspect", "plan"):
        done = run_cli(command, v3_store, "--ep-size", 3, check=False)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert ("sglang cannot place the store's 8 experts over EP 3; EP sizes that work for every MoE layer: "
                "1, 2, 4, 8") in done.stderr


def test_preload_of_an_fp8_conversion_starts_sglangs_daemons_and_refuses_vllms(v3_store, v3_converted):
    """``megamoe preload`` starts the weight-cache daemons of the engine a conversion is made for (a
    store: the engine that serves its family): SGLang's for these, which this environment cannot
    import, so it says which python to run; vLLM's (``--engine vllm``) is refused before anything
    starts, naming what serves it."""
    for out in (v3_store, v3_converted):
        done = run_cli("preload", "--model", out, check=False)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "needs SGLang 0.5.23" in done.stderr and "SGLANG_ENV/bin/python -m megamoe_convert.cli" in done.stderr
    done = run_cli("preload", "--model", v3_store, "--engine", "vllm", check=False)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "which vLLM cannot serve" in done.stderr and "serve it with SGLang 0.5.23 on Hopper" in done.stderr
    done = run_cli("preload", "--model", v3_converted, "--engine", "vllm", check=False)
    assert done.returncode == 2 and "converted for sglang's expert placement, not vllm's" in done.stderr
