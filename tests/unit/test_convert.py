"""`megamoe convert` end to end: real CLI subprocesses on synthesized checkpoints on disk.

The reference for every rank shard is computed from the source with the plain
``safetensors`` library (an independent reader) and ``transform.transform_experts``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import xxhash
from conftest import REPO, output_files, run_cli
from safetensors import safe_open
from safetensors.torch import save_file

from megamoe_convert.convert.plan import ConvertOptions
from megamoe_convert.convert.run import convert as convert_library
from megamoe_convert.errors import LoadError
from megamoe_convert.layout import transform
from megamoe_convert.layout.placement import Placement
from megamoe_convert.output import marker
from megamoe_convert.serve.loader import load_rank
from megamoe_convert.source.safetensors_io import read_header
from megamoe_convert.synth.write import synthesize


def source_tensors(src: Path) -> dict[str, torch.Tensor]:
    index = json.loads((src / "model.safetensors.index.json").read_text())
    out = {}
    for filename in sorted(set(index["weight_map"].values())):
        with safe_open(src / filename, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def expected_layer(src_tensors: dict[str, torch.Tensor], prefix: str, ids: tuple[int, ...]):
    def stack(projs, kind):
        return torch.stack([torch.cat([src_tensors[f"{prefix}.{e}.{p}.{kind}"].view(torch.uint8) for p in projs])
                            for e in ids])
    return transform.transform_experts(stack(("w1", "w3"), "weight"), stack(("w1", "w3"), "scale"),
                                    stack(("w2",), "weight"), stack(("w2",), "scale"))


def assert_rank_matches_source(out: Path, src: Path, rank: int, placement: Placement, layers: list[str]) -> None:
    tensors = source_tensors(src)
    loaded = load_rank(out, rank)
    assert sorted(loaded) == sorted(f"{key}.ffn.experts" for key in layers)
    for prefix, layer in loaded.items():
        assert layer.logical_ids == placement.rank_logical_ids(rank)
        assert layer.experts_start_idx == placement.experts_start(rank)
        want = expected_layer(tensors, prefix, layer.logical_ids)
        for got, ref in zip((*layer.l1, *layer.l2), (*want[0], *want[1]), strict=True):
            assert got.dtype == ref.dtype and got.shape == ref.shape and got.stride() == ref.stride()
            assert torch.equal(got, ref), f"rank {rank} {prefix}"


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("weight_dtype,scale_dtype,ep_size,redundant", [
    ("int8", "e8m0", 1, 0),
    ("float4", "e8m0", 2, 0),
    ("uint8", "uint8", 4, 4),
    ("int8", "e8m0", 8, 8),
])
def test_every_rank_equals_the_layout_of_its_source_experts(tmp_path, weight_dtype, scale_dtype, ep_size, redundant):
    src = tmp_path / "src"
    synthesize(src, "tiny", seed=ep_size, weight_dtype=weight_dtype, scale_dtype=scale_dtype)
    out = tmp_path / "out"
    proc = run_cli("convert", src, out, "--ep-size", ep_size, "--num-redundant-experts", redundant, "--json")
    summary = json.loads(proc.stdout)
    assert summary["ep_size"] == ep_size and summary["files_skipped"] == 0
    placement = Placement.default(8, ep_size, redundant)
    for rank in range(ep_size):
        assert_rank_matches_source(out, src, rank, placement, ["layers.0", "layers.1", "mtp.0"])


def test_hidden_not_twice_intermediate_and_chunked_streaming_give_the_reference_layout(tmp_path):
    """H=1024, I=384 (so H != 2I, and I/128 = 3 is odd), ~0.7 MB per expert read 1 MB at a time:
    a layer's experts stream through several chunks and still equal the one-shot transform."""
    config = json.loads((REPO / "configs" / "tiny.json").read_text())
    config.update(hidden_size=1024, moe_intermediate_size=384, n_routed_experts=6, num_experts_per_tok=2)
    (tmp_path / "dims.json").write_text(json.dumps(config))
    src, out = tmp_path / "src", tmp_path / "out"
    synthesize(src, str(tmp_path / "dims.json"), layers=2, mtp_layers=0, seed=11)
    run_cli("convert", src, out, "--ep-size", 1, "--chunk-mb", 1, "--workers", 2)
    assert_rank_matches_source(out, src, 0, Placement.default(6, 1, 0), ["layers.0", "layers.1"])


def test_manifest_records_everything_and_checksums_are_real(tiny_ckpt, tiny_converted):
    manifest = json.loads((tiny_converted / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["format_version"] == 2 and manifest["layout_version"] == 1
    assert manifest["ep_size"] == 4 and manifest["ranks"] == [0, 1, 2, 3]
    assert manifest["placement"]["physical_to_logical"] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert manifest["dims"] == {"hidden_size": 256, "moe_intermediate_size": 128, "n_routed_experts": 8,
                                "weight_format": "mxfp4", "shared_intermediate_size": 128}
    assert [layer["key"] for layer in manifest["layers"]] == ["layers.0", "layers.1", "mtp.0"]
    assert manifest["layers"][2] == {"key": "mtp.0", "prefix": "mtp.0.ffn.experts"}
    assert manifest["family"] == "deepseek_v4"
    src_sizes = {p.name: p.stat().st_size for p in tiny_ckpt.glob("*.safetensors")}
    assert manifest["source"]["files"] == src_sizes and len(manifest["source"]["index_sha256"]) == 64
    listed = {f["path"]: f for f in manifest["files"]}
    on_disk = output_files(tiny_converted)
    assert set(on_disk) - set(listed) == {"manifest.json"}  # the index too is listed
    for path, record in listed.items():
        assert record["size"] == len(on_disk[path])
        assert record["checksum"] == xxhash.xxh3_128_hexdigest(on_disk[path])
    assert sum(1 for p in listed if p.startswith("rank-00002-of-00004/")) == 3


def test_rank_shards_are_plain_safetensors_with_recoverable_strides(tiny_converted):
    with safe_open(tiny_converted / "rank-00001-of-00004" / "layers.1.safetensors", framework="pt") as f:
        assert f.metadata()["layer"] == "layers.1"
        storage = f.get_tensor("layers.1.ffn.experts.l1.sf")
        ids = f.get_tensor("layers.1.ffn.experts.logical_ids")
    assert storage.dtype == torch.int32 and tuple(storage.shape) == (3, 2, 256)  # [E, packed_k, MN]
    kernel_view = storage.transpose(1, 2)
    assert kernel_view.stride() == (512, 1, 256)  # exact MN-major strides with a view, no copy
    assert ids.tolist() == [3, 4, 5]


def test_non_expert_tensors_and_small_files_are_copied_byte_identical(tiny_ckpt, tiny_converted):
    src = source_tensors(tiny_ckpt)
    index = json.loads((tiny_converted / "model.safetensors.index.json").read_text())
    non_expert = {n for n in src if ".ffn.experts." not in n}
    assert set(index["weight_map"]) == non_expert
    for filename in set(index["weight_map"].values()):
        with safe_open(tiny_converted / filename, framework="pt") as f:
            for name in f.keys():
                got = f.get_tensor(name)
                assert got.dtype == src[name].dtype and got.shape == src[name].shape
                assert torch.equal(got.view(torch.uint8), src[name].view(torch.uint8))
    assert (tiny_converted / "tokenizer_config.json").read_bytes() == (tiny_ckpt / "tokenizer_config.json").read_bytes()
    # config.json: the source's with the serving marker, nothing else changed (test_marker.py)
    assert marker.original(json.loads((tiny_converted / "config.json").read_bytes())) == \
        json.loads((tiny_ckpt / "config.json").read_bytes())


# ----------------------------------------------------------------------------- options


def test_subsets_experts_only_and_explicit_placement(tiny_ckpt, tmp_path):
    placement = [7, 6, 5, 4, 3, 2, 1, 0]
    (tmp_path / "eplb.json").write_text(json.dumps(placement))
    out = tmp_path / "out"
    args = ("--ep-size", 2, "--placement", tmp_path / "eplb.json", "--ranks", "1", "--layers", "1,mtp",
            "--experts-only")
    for command, target in (("convert", (out,)), ("plan", ())):  # vLLM would refuse it at load time: refused now
        proc = run_cli(command, tiny_ckpt, *target, *args[:4], check=False)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "vLLM serves MegaMoE experts only in its default placement" in proc.stderr
        assert "--num-redundant-experts R" in proc.stderr and "--engine sglang" in proc.stderr
    assert not out.exists()
    assert run_cli("plan", tiny_ckpt, *args[:4], "--engine", "sglang", "--json").returncode == 0  # SGLang takes it
    convert_library(tiny_ckpt, out, ConvertOptions(2, placement_file=tmp_path / "eplb.json", ranks="1",
                                                   layers="1,mtp", experts_only=True, check_serving=False))
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "config.json", "manifest.json", "rank-00001-of-00002", "tokenizer_config.json"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["ranks"] == [1] and manifest["experts_only"] is True
    assert manifest["placement"]["default"] is False
    assert_rank_matches_source(out, tiny_ckpt, 1, Placement(8, 2, tuple(placement)), ["layers.1", "mtp.0"])
    with pytest.raises(LoadError, match="rank 0 was not converted"):
        load_rank(out, 0)
    report = json.loads(run_cli("verify", out, "--source", tiny_ckpt, "--json").stdout)  # checks what was converted
    assert report["ok"] and report["checks"]["rank_shards"] == 2
    assert report["partial"] is True and report["servable"] is False
    assert report["coverage"]["missing_ranks"] == [0] and report["coverage"]["missing_layers"] == ["layers.0"]
    assert manifest["coverage"]["partial"] is True and manifest["source_layers"] == ["layers.0", "layers.1", "mtp.0"]
    proc = run_cli("verify", out, "--ranks", "0", "--json", check=False)  # asking for more is a problem
    assert proc.returncode == 1 and "rank 0: not converted" in proc.stdout


def test_placement_and_redundant_experts_together_are_refused(tiny_ckpt, tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(list(range(8))))
    for command in ("plan", "convert"):
        target = () if command == "plan" else (tmp_path / "out",)
        proc = run_cli(command, tiny_ckpt, *target, "--ep-size", 2, "--placement", tmp_path / "p.json",
                       "--num-redundant-experts", 2, check=False)
        assert proc.returncode == 2 and "either --placement or --num-redundant-experts" in proc.stderr
    assert not (tmp_path / "out").exists() or not (tmp_path / "out" / "manifest.json").exists()


def test_plan_shows_an_explicit_placement(tiny_ckpt, tmp_path):
    (tmp_path / "p.json").write_text(json.dumps([7, 6, 5, 4, 3, 2, 1, 0, 0, 1]))
    got = json.loads(run_cli("plan", tiny_ckpt, "--ep-size", 2, "--placement", tmp_path / "p.json", "--engine",
                             "sglang", "--layers", "0-1", "--json").stdout)
    assert Placement.from_json(got) == Placement(8, 2, (7, 6, 5, 4, 3, 2, 1, 0, 0, 1))
    table = run_cli("plan", tiny_ckpt, "--ep-size", 2, "--placement", tmp_path / "p.json", "--engine", "sglang",
                    "--layers", "0-1", env={"COLUMNS": "200"}).stdout
    assert "0..4" in table and "5..9" in table


def test_single_file_checkpoint_without_an_index_converts_to_the_same_experts(tiny_ckpt, tiny_converted, tmp_path):
    """Small models ship one ``model.safetensors`` and no index: same expert bytes as the sharded form."""
    src = tmp_path / "single"
    src.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copy(tiny_ckpt / name, src / name)
    save_file(source_tensors(tiny_ckpt), src / "model.safetensors")
    out = tmp_path / "out"
    run_cli("convert", src, out, "--ep-size", 4, "--num-redundant-experts", 4, "--experts-only")
    converted = output_files(out)
    reference = output_files(tiny_converted)
    rank_files = [path for path in reference if path.startswith("rank-")]
    assert rank_files and all(converted[path] == reference[path] for path in rank_files)
    assert run_cli("verify", out, "--source", src).returncode == 0


@pytest.mark.parametrize("spec, message", [
    ("1-0", r"'1-0' is an empty range \(write it low-high, e.g. 0-1\)"),
    ("0-", r"cannot parse '0-'"),
    ("7", r"--layers: '7' is outside 0..1"),
    ("0-20000000", r"--layers: '0-20000000' is outside 0..1"),
])
def test_layer_selections_that_select_nothing_or_too_much_are_refused(tiny_ckpt, spec, message):
    from megamoe_convert.convert.plan import select_layers
    from megamoe_convert.errors import ConvertError
    from megamoe_convert.source.checkpoint import Checkpoint

    with pytest.raises(ConvertError, match=message):
        select_layers(Checkpoint.open(tiny_ckpt), spec)


def test_mtp_selection_on_a_checkpoint_without_mtp_is_refused_and_writes_nothing(tmp_path):
    """An empty selection would otherwise give a 'finished' conversion with no experts."""
    synthesize(tmp_path / "src", "tiny", mtp_layers=0)
    proc = run_cli("convert", tmp_path / "src", tmp_path / "out", "--ep-size", 2, "--layers", "mtp", check=False)
    assert proc.returncode == 2 and "--layers mtp: selects no MoE layer" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_inspect_and_plan_report_the_checkpoint(tiny_ckpt):
    info = json.loads(run_cli("inspect", tiny_ckpt, "--ep-size", 4, "--json").stdout)
    assert info["moe_layers"] == ["layers.0", "layers.1", "mtp.0"] and info["mtp_layers"] == ["mtp.0"]
    assert info["dims"]["n_routed_experts"] == 8 and info["expert_dtypes"]["w1.scale"] == "F8_E8M0"
    conversion = info["conversion"]  # what convert --ep-size 4 writes, shared expert and headers included
    assert conversion["expert_bytes_per_rank"] * 4 == conversion["expert_bytes_total"] > info["expert_bytes"]
    table = run_cli("inspect", tiny_ckpt).stdout  # no --ep-size: the EP sizes that work, nothing fails
    assert "2 decoder + 1 MTP" in table and "EP sizes for vllm" in table and "1, 2, 4, 8" in table
    plan = json.loads(run_cli("plan", tiny_ckpt, "--ep-size", 4, "--num-redundant-experts", 4, "--json").stdout)
    assert plan["physical_to_logical"][8:] == [0, 1, 2, 3]
    assert "6, 7, 0" in run_cli("plan", tiny_ckpt, "--ep-size", 4, "--num-redundant-experts", 4).stdout


# ----------------------------------------------------------------------------- resume and refusal


def test_rerun_skips_verified_files_and_redoes_damaged_ones(tiny_ckpt, tmp_path):
    out = tmp_path / "out"
    args = ("convert", tiny_ckpt, out, "--ep-size", 2, "--json")
    first = json.loads(run_cli(*args).stdout)
    clean = output_files(out)
    again = json.loads(run_cli(*args).stdout)
    assert again["files_written"] == 0 and again["files_skipped"] == first["files_written"]
    (out / "rank-00000-of-00002" / "layers.1.safetensors").unlink()
    damaged = out / "rank-00001-of-00002" / "mtp.0.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-100] ^= 0xFF  # same size, different checksum
    damaged.write_bytes(bytes(data))
    resumed = json.loads(run_cli(*args).stdout)
    assert resumed["files_written"] == 2
    assert output_files(out) == clean


def test_different_options_over_existing_output_are_refused_unless_overwrite(tiny_ckpt, tmp_path):
    out = tmp_path / "out"
    run_cli("convert", tiny_ckpt, out, "--ep-size", 2)
    proc = run_cli("convert", tiny_ckpt, out, "--ep-size", 4, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "different options" in proc.stderr and "--overwrite" in proc.stderr
    assert json.loads((out / "manifest.json").read_text())["ep_size"] == 2  # untouched
    run_cli("convert", tiny_ckpt, out, "--ep-size", 4, "--overwrite")
    assert json.loads((out / "manifest.json").read_text())["ep_size"] == 4
    assert not (out / "rank-00000-of-00002").exists()


def test_foreign_non_empty_output_directory_is_refused(tiny_ckpt, tmp_path):
    out = tmp_path / "important"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for extra in ((), ("--overwrite",)):
        proc = run_cli("convert", tiny_ckpt, out, "--ep-size", 2, *extra, check=False)
        assert proc.returncode == 2 and "not a megamoe output" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def rewrite_expert_byte_in_place(src: Path, name: str) -> Path:
    """Flip the first byte of tensor ``name`` in its shard, in place (same size, same inode),
    and move the shard's mtime on by a second; returns the shard."""
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"][name]
    begin = read_header(shard).tensors[name].begin
    with open(shard, "r+b") as f:
        f.seek(begin)
        byte = f.read(1)[0]
        f.seek(begin)
        f.write(bytes([byte ^ 0xFF]))
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    return shard


def test_source_rewritten_in_place_is_never_resumed_against(tiny_ckpt, tmp_path):
    src, out, fresh = tmp_path / "src", tmp_path / "out", tmp_path / "fresh"
    shutil.copytree(tiny_ckpt, src)
    args = ("--ep-size", 2, "--json")
    run_cli("convert", src, out, *args)
    before = output_files(out)
    size = (shard := rewrite_expert_byte_in_place(src, "layers.1.ffn.experts.5.w2.weight")).stat().st_size
    assert shard.stat().st_size == size  # same size, same index: only the bytes and the mtime changed

    proc = run_cli("convert", src, out, *args, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and shard.name in proc.stderr and "--overwrite" in proc.stderr
    assert output_files(out) == before  # refused before anything was touched

    redone = json.loads(run_cli("convert", src, out, *args, "--overwrite").stdout)
    assert redone["files_skipped"] == 0
    run_cli("convert", src, fresh, *args)
    assert output_files(out) == output_files(fresh) != before
    again = json.loads(run_cli("convert", src, out, *args).stdout)  # unchanged source: resumes as before
    assert again["files_written"] == 0


@pytest.mark.parametrize("state_file, damage", [("plan.json", b"{\"ep_si"), ("source.json", b"[1, 2]")])
def test_damaged_resume_state_is_refused_then_overwrite_recovers(tiny_ckpt, tiny_converted, tmp_path, state_file,
                                                                 damage):
    """A state file cut short or edited says nothing reliable about OUT: refuse to resume
    against it (one line, no traceback), and let --overwrite start again."""
    out, args = tmp_path / "out", ("--ep-size", 4, "--num-redundant-experts", 4)
    run_cli("convert", tiny_ckpt, out, *args, "--no-fsync")
    (out / ".megamoe" / state_file).write_bytes(damage)
    proc = run_cli("convert", tiny_ckpt, out, *args, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0
    assert "--overwrite" in proc.stderr and (state_file in proc.stderr or "source files changed" in proc.stderr)
    redone = json.loads(run_cli("convert", tiny_ckpt, out, *args, "--overwrite", "--json").stdout)
    assert redone["files_skipped"] == 0
    assert output_files(out) == output_files(tiny_converted)


def test_overwrite_leaves_no_stale_index_and_keeps_user_files(tiny_ckpt, tmp_path):
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    run_cli("convert", tiny_ckpt, out, "--ep-size", 2)
    assert (out / "model.safetensors.index.json").exists()
    (out / "NOTES.md").write_text("mine")
    run_cli("convert", tiny_ckpt, out, "--ep-size", 2, "--experts-only", "--overwrite")
    run_cli("convert", tiny_ckpt, fresh, "--ep-size", 2, "--experts-only")
    assert output_files(out) == output_files(fresh) | {"NOTES.md": b"mine"}  # no index, no model-*.safetensors


def test_overwrite_forgets_the_parts_of_a_merged_conversion(tiny_ckpt, tmp_path):
    out = tmp_path / "out"
    run_cli("convert", tiny_ckpt, out, "--ep-size", 2, "--experts-only", "--shard", "0/1")  # merges itself
    assert list((out / ".megamoe" / "parts").glob("manifest.part-*"))
    run_cli("convert", tiny_ckpt, out, "--ep-size", 2, "--overwrite")
    assert not (out / ".megamoe" / "parts").exists()
    # A later merge must not bring the replaced conversion back over the new one.
    proc = run_cli("merge", out, check=False)
    assert proc.returncode == 2 and "no part manifests" in proc.stderr
    assert json.loads((out / "manifest.json").read_text())["experts_only"] is False


def test_cuda_device_without_gpu_is_a_clear_error(tiny_ckpt, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_cli("convert", tiny_ckpt, tmp_path / "o", "--ep-size", 2, "--device", "cuda", check=False)
    assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- memory


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_convert_on_cuda_writes_the_same_bytes_as_on_cpu(tiny_ckpt, tmp_path):
    run_cli("convert", tiny_ckpt, tmp_path / "cpu", "--ep-size", 4, "--num-redundant-experts", 4)
    run_cli("convert", tiny_ckpt, tmp_path / "gpu", "--ep-size", 4, "--num-redundant-experts", 4, "--device", "cuda")
    cpu, gpu = output_files(tmp_path / "cpu"), output_files(tmp_path / "gpu")
    assert cpu.keys() == gpu.keys()
    assert all(cpu[k] == gpu[k] for k in cpu)
