"""The format table, and conversions of every format and of the shared expert, on real files and CLI runs."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli

from megamoe_convert.layout import inverse
from megamoe_convert.serve.loader import load_rank
from megamoe_convert.source import formats
from megamoe_convert.source.checkpoint import Checkpoint
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import FileCache, read_header

# hidden, intermediate and expert counts, named as in the layout's notation
H, I, E = 256, 128, 3  # noqa: E741


@pytest.mark.parametrize("name,l1_weight,l1_sf,extra", [
    # vLLM 0.33 _register_weight: weight [E, N, K / values_per_element], scales int32 [E, K / (4 * group), N]
    ("mxfp4", ("I8", (E, 2 * I, H // 2)), (E, H // 128, 2 * I), []),
    ("mxfp8", ("F8_E4M3", (E, 2 * I, H)), (E, H // 128, 2 * I), []),
    ("nvfp4", ("I8", (E, 2 * I, H // 2)), (E, H // 64, 2 * I),
     ["l1_global_scale", "l2_global_scale", "l2_input_scale", "l2_input_scale_all"]),
    ("bf16", ("BF16", (E, 2 * I, H)), None, []),
    # SGLang's SM90 FP8 MegaMoE: w13_weight / w13_weight_scale_inv as build_sm90_mega_moe_experts_weights leaves them
    ("fp8_block", ("F8_E4M3", (E, 2 * I, H)), (E, 2 * I // 128, H // 128), []),
])
def test_rank_file_tensors_of_each_format(name, l1_weight, l1_sf, extra):
    specs = formats.spec_keys(formats.rank_tensor_specs(formats.by_name(name), "p", E, H, I, 8, shared_inter=I), "p")
    assert (specs["l1_weight"].dtype, specs["l1_weight"].shape) == l1_weight
    assert (specs["l1_sf"].shape if "l1_sf" in specs else None) == l1_sf
    assert [k for k in specs if k in formats.GLOBAL_SCALE_KEYS or k == "l2_input_scale_all"] == extra
    assert specs["shared_l1_weight"].shape == (2 * I, H) and specs["shared_l1_sf"].shape == (H // 128, 2 * I)
    for spec in specs.values():
        numel = 1
        for d in spec.shape:
            numel *= d
        assert spec.nbytes == numel * formats.DTYPE_BITS[spec.dtype] // 8


@pytest.mark.parametrize("weight,scale,message", [
    ("F8_E4M3", "I32", "F8_E4M3 weights with I32 scales are no MegaMoE weight format"),
    ("I8", None, "I8 weights without scales are no MegaMoE weight format"),
])
def test_unsupported_expert_dtypes_are_refused_naming_what_was_found(weight, scale, message):
    with pytest.raises(formats.FormatError, match=message):
        formats.identify(weight, scale, "x")


@pytest.mark.parametrize("weight_format", ["mxfp8", "nvfp4", "bf16"])
def test_each_format_converts_inspects_and_verifies_through_the_cli(tmp_path, weight_format):
    src, out = tmp_path / "src", tmp_path / "out"
    run_cli("synth", src, "--format", weight_format, "--experts", 4, "--layers", 1, "--mtp-layers", 0)
    summary = json.loads(run_cli("inspect", src, "--ep-size", 2, "--json").stdout)
    assert summary["weight_format"] == weight_format and summary["model_type"] == "deepseek_v4"
    assert summary["shared_intermediate_size"] == (0 if weight_format == "bf16" else I)
    assert summary["shared_expert_prebaked"] is (weight_format != "bf16")
    run_cli("convert", src, out, "--ep-size", 2)
    sizes = summary["conversion"]  # the format's extras (NVFP4 global scales) counted as convert writes them
    assert [sizes["rank_bytes"][str(r)] for r in range(2)] == [
        sum(p.stat().st_size for p in (out / f"rank-{r:05d}-of-00002").iterdir()) for r in range(2)]
    assert json.loads((out / "manifest.json").read_text())["dims"]["weight_format"] == weight_format
    report = json.loads(run_cli("verify", out, "--source", src, "--numerics", "--json").stdout)
    assert report["ok"] and report["checks"]["expert_slots_vs_source"] == 4, report
    numerics = report["numerics"]  # every format's dequantisation, from the layout and from the source
    assert "numerics" not in report["skipped"] and numerics["weight_format"] == weight_format
    assert numerics["max_abs_err"] == 0.0 and numerics["layers"] == 2
    assert numerics["shared_experts"] == (0 if weight_format == "bf16" else 2)
    layer = load_rank(out, 1)["layers.0.ffn.experts"]
    want = {"mxfp8": torch.float8_e4m3fn, "nvfp4": torch.int8, "bf16": torch.bfloat16}[weight_format]
    assert layer.l1.weight.dtype == want and (layer.l1.sf is None) == (weight_format == "bf16")


def test_the_shared_expert_is_pre_baked_from_its_fp8_block_checkpoint(tiny_ckpt, tiny_converted):
    """Undo the layout of the rank file's shared expert: the checkpoint's w1/w3/w2 bytes, and its
    128x128 block scales repeated over every 1x32 group they cover."""
    ckpt = Checkpoint.open(tiny_ckpt)
    s = ckpt.dims.shared_intermediate_size
    assert s == I and ckpt.shared_expert_note is None
    layer = MoELayer(True, 0)
    with FileCache() as files:
        raw = {(p, k): files.read(ckpt.shared_entry(layer, p, k))
               for p in ("w1", "w2", "w3") for k in ("weight", "scale")}
    for rank in (0, 3):
        (l1w, l1sf), (l2w, l2sf) = load_rank(tiny_converted, rank)[layer.prefix].shared
        w13 = inverse.deinterleave_gate_up(l1w.view(torch.uint8).unsqueeze(0))[0]
        assert torch.equal(w13, torch.cat([raw["w1", "weight"], raw["w3", "weight"]]))
        assert torch.equal(l2w.view(torch.uint8), raw["w2", "weight"])
        sf13 = inverse.unpack_ue8m0(
            inverse.deinterleave_gate_up(inverse.untranspose_sf_for_utccp(l1sf.unsqueeze(0))), H // 32)[0]
        for half, proj in enumerate(("w1", "w3")):
            block = raw[proj, "scale"]
            for r, c in ((0, 0), (s - 1, H // 32 - 1), (77, 5)):
                assert sf13[half * s + r, c] == block[r // 128, c // 4]
        sf2 = inverse.unpack_ue8m0(inverse.untranspose_sf_for_utccp(l2sf.unsqueeze(0)), s // 32)[0]
        assert torch.equal(sf2, raw["w2", "scale"].repeat_interleave(128, 0).repeat_interleave(4, 1))


def test_a_checkpoint_of_fp8_block_experts_is_refused_in_one_line(tmp_path):
    src = tmp_path / "src"
    run_cli("synth", src, "--experts", 4, "--layers", 1, "--mtp-layers", 0)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "expert_dtype": "fp8"}))
    proc = run_cli("convert", src, tmp_path / "out", "--ep-size", 2, check=False)
    assert proc.returncode == 2 and "expert_dtype is 'fp8' (FP8 block-scaled experts" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("weight_format,tensor,what", [
    ("mxfp8", "l2.sf", "MoE output"),  # an e8m0 block scale (the byte check sees it too)
    ("nvfp4", "l1.global_scale", "MoE output"),  # an FP32 global scale: only the numerics see it
    ("bf16", "l1.weight", "MoE output"),
    ("mxfp4", "shared_l2.weight", "shared expert output"),  # the pre-baked shared expert: numerics only
])
def test_numerics_catch_a_changed_byte_of_each_format(tmp_path, weight_format, tensor, what):
    """One byte of a rank file changed and the manifest resealed: ``--numerics`` dequantises the
    format from both sides and reports the layer."""
    from test_verify import rewrite_manifest_record

    from megamoe_convert.convert.plan import ConvertOptions
    from megamoe_convert.convert.run import convert
    from megamoe_convert.synth.write import synthesize
    from megamoe_convert.verify import verify

    src, out = tmp_path / "src", tmp_path / "out"
    synthesize(src, "tiny", experts=4, layers=1, mtp_layers=0, seed=3, weight_format=weight_format)
    convert(src, out, ConvertOptions(ep_size=2, fsync=False))
    assert verify(out, source=src, numerics=True).ok
    rel = "rank-00001-of-00002/layers.0.safetensors"
    entry = read_header(out / rel).tensors[f"layers.0.ffn.experts.{tensor}"]
    data = bytearray((out / rel).read_bytes())
    at = entry.begin + (3 if tensor.endswith("global_scale") else 1 if weight_format == "bf16" else 0)
    data[at] = 0x38 if data[at] != 0x38 else 0x40  # a finite value of every element type, and another exponent
    (out / rel).write_bytes(bytes(data))
    rewrite_manifest_record(out, rel)
    report = verify(out, source=src, numerics=True)
    numerics = [p for p in report.problems if "pre-baked layout" in p.what]
    assert not report.ok and len(numerics) == 1 and numerics[0].where == "rank 1 layers.0"
    assert numerics[0].what.startswith(f"{what} from the pre-baked layout differs from the source")
