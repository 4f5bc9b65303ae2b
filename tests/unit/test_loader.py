"""`load_rank`: exact kernel tensors, lazily mapped on CPU, pipelined to a GPU, refusing what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli
from test_convert import assert_rank_matches_source

from megamoe_convert.errors import LoadError, MegamoeError
from megamoe_convert.layout import inverse
from megamoe_convert.output.manifest import read_manifest
from megamoe_convert.output.seal import seal
from megamoe_convert.serve import load_checks, loader, staging
from megamoe_convert.serve.loader import load_rank
from megamoe_convert.source import formats
from megamoe_convert.synth.write import synthesize


def test_every_rank_round_trips_with_exact_dtypes_shapes_strides(tiny_ckpt, tiny_converted):
    manifest = read_manifest(tiny_converted)
    for rank in range(4):
        assert_rank_matches_source(tiny_converted, tiny_ckpt, rank, manifest.placement,
                                   ["layers.0", "layers.1", "mtp.0"])
        layer = load_rank(tiny_converted, rank)["mtp.0.ffn.experts"]
        e, h, i = 3, 256, 128
        assert layer.l1.weight.dtype == torch.int8 and layer.l1.weight.shape == (e, 2 * i, h // 2)
        assert layer.l1.sf.dtype == torch.int32 and layer.l1.sf.shape == (e, 2 * i, h // 128)
        assert layer.l1.sf.stride() == (h // 128 * 2 * i, 1, 2 * i)
        assert layer.l2.sf.shape == (e, h, i // 128) and layer.l2.sf.stride() == (i // 128 * h, 1, h)
        assert layer.num_local_experts == 3 and layer.experts_start_idx == 3 * rank
        # vLLM's EPLB views: [E, -1] of contiguous weights and of transposed scales.
        assert layer.l1.weight.view(e, -1).shape == (e, 2 * i * h // 2)
        assert layer.l1.sf.transpose(1, 2).is_contiguous()


def test_layers_subset_and_verify(tiny_converted):
    subset = load_rank(tiny_converted, 2, layers=["layers.1", "mtp.0.ffn.experts"], verify=True)
    assert sorted(subset) == ["layers.1.ffn.experts", "mtp.0.ffn.experts"]
    with pytest.raises(LoadError, match="layer 'layers.9' is not in this conversion"):
        load_rank(tiny_converted, 0, layers=["layers.9"])


def test_a_reconversion_never_changes_tensors_already_mapped(tiny_ckpt, tmp_path):
    """A rank mapped by a running server keeps its bytes while OUT is converted again (files are
    replaced by rename, never rewritten in place)."""
    out = tmp_path / "out"
    run_cli("convert", tiny_ckpt, out, "--ep-size", 2, "--experts-only", "--no-fsync")
    mapped = load_rank(out, 0)
    before = {prefix: [t.clone() for t in (*e.l1, *e.l2)] for prefix, e in mapped.items()}
    run_cli("convert", tiny_ckpt, out, "--ep-size", 2, "--num-redundant-experts", 2, "--experts-only",
            "--overwrite", "--no-fsync")
    reloaded = load_rank(out, 0)
    assert any(reloaded[p].logical_ids != mapped[p].logical_ids for p in mapped)  # it did change
    for prefix, e in mapped.items():
        assert all(torch.equal(a, b) for a, b in zip((*e.l1, *e.l2), before[prefix], strict=True))


def test_cpu_tensors_are_writable_private_maps(tiny_converted, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(tiny_converted, out)
    path = out / "rank-00000-of-00004" / "layers.0.safetensors"
    before = path.read_bytes()
    layer = load_rank(out, 0)["layers.0.ffn.experts"]
    layer.l1.weight.zero_()  # copy-on-write: the process may scribble, the file never changes
    assert path.read_bytes() == before


# ----------------------------------------------------------------------------- refusals


def edited_copy(src: Path, tmp_path: Path, edit) -> Path:
    out = tmp_path / "edited"
    shutil.copytree(src, out)
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest, out)
    (out / "manifest.json").write_text(seal(manifest))
    return out


def test_wrong_rank_is_refused(tiny_converted):
    with pytest.raises(LoadError, match=r"rank 4 is out of range: .* ep_size=4 \(ranks 0..3\)"):
        load_rank(tiny_converted, 4)


def test_unknown_newer_layout_version_is_refused(tiny_converted, tmp_path):
    out = edited_copy(tiny_converted, tmp_path, lambda m, _: m.update(layout_version=2))
    with pytest.raises(MegamoeError, match="layout_version 2 is newer than this megamoe-convert understands"):
        load_rank(out, 0)


@pytest.mark.parametrize("version, message", [(1, "format_version 1 is not 2, the one this megamoe-convert reads"),
                                              (3, "format_version 3 is newer than this megamoe-convert understands")])
def test_a_manifest_of_another_format_version_is_refused(tiny_converted, tmp_path, version, message):
    out = edited_copy(tiny_converted, tmp_path, lambda m, _: m.update(format_version=version))
    with pytest.raises(MegamoeError, match=message):
        load_rank(out, 0)


def test_missing_and_resized_files_are_refused(tiny_converted, tmp_path):
    out = edited_copy(tiny_converted, tmp_path,
                      lambda m, o: (o / "rank-00001-of-00004" / "layers.0.safetensors").unlink())
    with pytest.raises(LoadError, match=r"rank-00001-of-00004/layers.0.safetensors: missing"):
        load_rank(out, 1)
    with open(out / "rank-00002-of-00004" / "mtp.0.safetensors", "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(LoadError, match=r"mtp.0.safetensors: size \d+ bytes, manifest.json records \d+"):
        load_rank(out, 2)


def test_rank_file_missing_from_the_manifest_is_refused_naming_it(tiny_converted, tmp_path):
    dropped = "rank-00001-of-00004/mtp.0.safetensors"
    out = edited_copy(tiny_converted, tmp_path,
                      lambda m, _: m.update(files=[f for f in m["files"] if f["path"] != dropped]))
    # The manifest no longer covers every rank x layer: it is refused whole, naming the file.
    for layers in (None, ["layers.0", "layers.1"]):
        message = rf"{out / 'manifest.json'}: {dropped}: rank 1 x mtp.0 is not listed"
        with pytest.raises(MegamoeError, match=message) as info:
            load_rank(out, 1, layers=layers)
        assert "\n" not in str(info.value)


def test_manifest_of_another_ep_size_is_refused(tiny_converted, tmp_path):
    def other_ep(manifest, _):
        manifest["placement"]["ep_size"] = manifest["ep_size"] = 2
        manifest["placement"]["experts_per_rank"] = 6
    out = edited_copy(tiny_converted, tmp_path, other_ep)
    with pytest.raises(MegamoeError, match=r"manifest.json: rank 2 out of range for ep_size=2"):
        load_rank(out, 0)

    def consistent_other_ep(manifest, _):  # a whole EP-2 manifest over EP-4 files
        other_ep(manifest, _)
        manifest["ranks"] = [0, 1]
        for record in manifest["files"]:
            record["path"] = record["path"].replace("-of-00004/", "-of-00002/")
    out = edited_copy(tiny_converted, tmp_path / "consistent", consistent_other_ep)
    with pytest.raises(MegamoeError, match=r"rank-00000-of-00002/layers.0.safetensors"):
        load_rank(out, 0)


def test_unfinished_directory_is_refused(tiny_converted, tmp_path):
    out = edited_copy(tiny_converted, tmp_path, lambda m, _: m.update(complete=False))
    with pytest.raises(MegamoeError, match="did not finish"):
        load_rank(out, 0)
    (out / "manifest.json").unlink()
    with pytest.raises(MegamoeError, match="not a finished megamoe conversion"):
        load_rank(out, 0)


def test_verify_true_catches_a_flipped_byte(tiny_converted, tmp_path):
    out = edited_copy(tiny_converted, tmp_path, lambda m, _: None)
    path = out / "rank-00003-of-00004" / "layers.1.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    load_rank(out, 3)  # size is right: without verify the damage is not seen ...
    with pytest.raises(LoadError, match="layers.1.safetensors: checksum mismatch"):
        load_rank(out, 3, verify=True)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_load_equals_cpu_load(tiny_converted):
    for rank in range(4):
        cpu = load_rank(tiny_converted, rank)
        gpu = load_rank(tiny_converted, rank, device="cuda", verify=True)
        for prefix in cpu:
            for a, b in zip((*cpu[prefix].l1, *cpu[prefix].l2), (*gpu[prefix].l1, *gpu[prefix].l2), strict=True):
                assert b.is_cuda and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
                assert torch.equal(a, b.cpu())


def _into(converted: Path, rank: int, device: str) -> dict[str, dict[str, torch.Tensor]]:
    """Caller-owned destinations of one rank, filled with a marker byte, in the rank files' form."""
    manifest = read_manifest(converted)
    into = {}
    for layer, record in load_checks.check_rank_files(converted, manifest, rank, manifest.layers, False).items():
        entries = load_checks.check_shard(loader.read_header(converted / record.path), manifest, layer, rank)
        into[layer.prefix] = {key: _marked(torch.empty(e.shape, dtype=formats.torch_dtype(e.dtype), device=device))
                              for key, e in entries.items() if key != "logical_ids"}
    return into


def _marked(t: torch.Tensor) -> torch.Tensor:
    t.view(torch.uint8).fill_(0x5A)
    return t


def _untouched(into: dict[str, dict[str, torch.Tensor]]) -> bool:
    return all(bool((t.view(torch.uint8) == 0x5A).all()) for d in into.values() for t in d.values())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_before_writes_runs_before_any_byte_lands_and_its_refusal_leaves_every_destination_as_it_was(
        tiny_converted, device):
    """An install's probe runs beside the load's reads: nothing is written until it returns, and what
    it raises stops the load with every destination untouched (on the GPU, with the reads ahead)."""
    into = _into(tiny_converted, 1, device)

    def refuse():
        assert _untouched(into)
        raise MegamoeError("the probe says no")

    with pytest.raises(MegamoeError, match="the probe says no"):
        load_rank(tiny_converted, 1, into=into, before_writes=refuse)
    assert _untouched(into)
    calls = []
    loaded = load_rank(tiny_converted, 1, into=into, before_writes=lambda: calls.append(_untouched(into)))
    assert calls and calls[0]  # first called before any byte had landed (then once more by each GPU lane)
    for prefix, layer in load_rank(tiny_converted, 1).items():
        for a, b in zip((*layer.l1, *layer.l2), (*loaded[prefix].l1, *loaded[prefix].l2), strict=True):
            assert torch.equal(a, b.cpu())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_load_of_a_large_rank_crosses_many_ring_buffers(tmp_path):
    """A rank bigger than the pinned ring (RING_BUFFERS x RING_BUFFER_BYTES) exercises buffer reuse and ordering."""
    config = json.loads((REPO / "configs" / "flash.json").read_text())
    config.update(n_routed_experts=48, num_hidden_layers=2, num_nextn_predict_layers=0, vocab_size=256)
    (tmp_path / "preset.json").write_text(json.dumps(config))
    synthesize(tmp_path / "src", str(tmp_path / "preset.json"))
    run_cli("convert", tmp_path / "src", tmp_path / "out", "--ep-size", 1, "--experts-only", "--no-fsync")
    cpu = load_rank(tmp_path / "out", 0)
    gpu = load_rank(tmp_path / "out", 0, device="cuda")
    total = 0
    for prefix in cpu:
        for a, b in zip((*cpu[prefix].l1, *cpu[prefix].l2), (*gpu[prefix].l1, *gpu[prefix].l2), strict=True):
            assert torch.equal(a, b.cpu())
            total += a.numel() * a.element_size()
    assert total > 2 * staging.ring_buffers() * staging.RING_BUFFER_BYTES
    # Dequantised from the GPU tensors == dequantised from the CPU ones (same bytes, same math).
    l1, l2 = gpu["layers.0.ffn.experts"].l1, gpu["layers.0.ffn.experts"].l2
    d_gpu = inverse.dequantize_transformed((l1.weight[:2], l1.sf[:2]), (l2.weight[:2], l2.sf[:2]))
    c = cpu["layers.0.ffn.experts"]
    d_cpu = inverse.dequantize_transformed((c.l1.weight[:2], c.l1.sf[:2]), (c.l2.weight[:2], c.l2.sf[:2]))
    assert all(torch.equal(x.cpu(), y) for x, y in zip(d_gpu, d_cpu, strict=True))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_loads_racing_the_background_pinning_and_each_other_are_exact(tiny_converted):
    """The ring pinned in the background (as an engine's loader starts it) and loads from several
    threads at once: every load waits for the ring and gets its own rank's exact bytes."""
    from concurrent.futures import ThreadPoolExecutor

    staging.prepare_gpu_staging()
    with ThreadPoolExecutor(4) as pool:
        gpu = list(pool.map(lambda r: load_rank(tiny_converted, r, device="cuda"), range(4)))
    for rank in range(4):
        cpu = load_rank(tiny_converted, rank)
        for prefix in cpu:
            for a, b in zip((*cpu[prefix].l1, *cpu[prefix].l2), (*gpu[rank][prefix].l1, *gpu[rank][prefix].l2),
                            strict=True):
                assert torch.equal(a, b.cpu())


def test_loading_under_a_default_device_context_still_reads_into_host_memory(tiny_converted):
    """Engines build models under ``with torch.device(...)``; the loader's own host buffers must
    not follow that default (on a GPU they became CUDA tensors and the read failed)."""
    plain = load_rank(tiny_converted, 1)
    with torch.device("meta"):
        under = load_rank(tiny_converted, 1)
    for prefix in plain:
        for a, b in zip((*plain[prefix].l1, *plain[prefix].l2), (*under[prefix].l1, *under[prefix].l2), strict=True):
            assert b.device.type == "cpu" and torch.equal(a, b)


def test_shard_whose_experts_disagree_with_the_manifest_placement_is_refused(tiny_converted, tmp_path):
    def swap_ranks(manifest, _):
        p = manifest["placement"]["physical_to_logical"]
        p[0:3], p[3:6] = p[3:6], p[0:3]
        manifest["placement"]["default"] = False  # a consistent forgery: only the shard can tell
    out = edited_copy(tiny_converted, tmp_path, swap_ranks)
    with pytest.raises(LoadError, match=r"holds logical experts \[0, 1, 2\], but manifest.json's placement gives "
                                        r"this rank \[3, 4, 5\]"):
        load_rank(out, 0)


@pytest.mark.parametrize("device, message", [("tpu", "is not a device"), ("meta", "is not supported"),
                                             ("cuda:7", "cuda:7")])
def test_unusable_devices_are_refused_before_any_file_is_read(tmp_path, device, message):
    """Checked before the directory is even opened: the path here does not exist."""
    if device == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 GPUs")
    with pytest.raises(MegamoeError, match=message):
        load_rank(tmp_path / "missing", 0, device=device)


def test_expected_ep_size_layer_spec_and_rank_type(tiny_converted):
    """A serving job can state the EP size it expects; layers can be named as on the command line."""
    with pytest.raises(LoadError, match=r"converted for ep_size=4, not 8; convert again with --ep-size 8"):
        load_rank(tiny_converted, 0, ep_size=8)
    assert sorted(load_rank(tiny_converted, 0, ep_size=4)) == [
        "layers.0.ffn.experts", "layers.1.ffn.experts", "mtp.0.ffn.experts"]
    assert sorted(load_rank(tiny_converted, 1, layers="1,mtp")) == ["layers.1.ffn.experts", "mtp.0.ffn.experts"]
    assert sorted(load_rank(tiny_converted, 1, layers="layers.0")) == ["layers.0.ffn.experts"]
    for bad in ("1", 1.0, True):
        with pytest.raises(LoadError, match="rank must be an int"):
            load_rank(tiny_converted, bad)
