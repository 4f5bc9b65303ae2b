"""The rank-agnostic store (``megamoe convert`` without ``--ep-size``) and reading any rank's slots
from it: real CLI subprocesses on real files, the per-rank form (``--ep-size``, itself checked
against the source in test_convert.py) and ``load_rank`` as the oracle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import output_files, run_cli
from safetensors import safe_open

from megamoe_convert.errors import LoadError
from megamoe_convert.layout.placement import Placement
from megamoe_convert.serve import store
from megamoe_convert.serve.loader import load_rank, open_converted
from megamoe_convert.source import safetensors_io


@pytest.fixture(scope="module")
def tiny_store(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("store") / "store"
    run_cli("convert", tiny_ckpt, out)
    return out


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_the_store_holds_every_logical_expert_once_in_the_kernel_layout(tiny_ckpt, tiny_store, tmp_path):
    manifest = json.loads((tiny_store / "manifest.json").read_text())
    assert manifest["store"] is True and manifest["engine"] == "any" and manifest["ep_size"] == 1
    layers = [layer["key"] for layer in manifest["layers"]]
    expert_files = sorted(f["path"] for f in manifest["files"] if f["path"].startswith("experts/"))
    assert expert_files == sorted(f"experts/{key}.safetensors" for key in layers)
    assert not list(tiny_store.glob("rank-*"))
    # the bytes of logical experts 0..n-1 in order: what an EP 1 per-rank conversion holds
    run_cli("convert", tiny_ckpt, tmp_path / "ep1", "--ep-size", 1)
    for key in layers:
        got = tensors(tiny_store / f"experts/{key}.safetensors")
        want = tensors(tmp_path / "ep1" / f"rank-00000-of-00001/{key}.safetensors")
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got), key
    # the non-expert shards and small files as a per-rank conversion writes them
    ep4 = output_files(tmp_path / "ep1")
    mine = output_files(tiny_store)
    for name in ("model-00001-of-00001.safetensors", "config.json"):
        assert mine[name] == ep4[name]


def test_a_store_resumes_and_refuses_per_rank_options_in_one_line(tiny_ckpt, tiny_store, tmp_path):
    again = json.loads(run_cli("convert", tiny_ckpt, tiny_store, "--json").stdout)
    assert again["files_written"] == 0 and again["files_skipped"] > 0 and again["store"] is True
    for flags, named in ((("--num-redundant-experts", 4), "--num-redundant-experts"), (("--ranks", "0"), "--ranks"),
                         (("--engine", "sglang"), "--engine")):
        proc = run_cli("convert", tiny_ckpt, tmp_path / named.strip("-"), *flags, check=False)
        assert proc.returncode != 0 and f"{named} needs --ep-size" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
        assert not (tmp_path / named.strip("-") / "manifest.json").exists()
    # a per-rank conversion into the store's folder is another plan: refused without --overwrite
    proc = run_cli("convert", tiny_ckpt, tiny_store, "--ep-size", 4, check=False)
    assert proc.returncode != 0 and (tiny_store / "manifest.json").exists()


def test_a_store_split_over_machines_merges_into_the_same_bytes(tiny_ckpt, tiny_store, tmp_path):
    for part in ("0/2", "1/2"):
        run_cli("convert", tiny_ckpt, tmp_path / "split", "--shard", part)
    assert output_files(tmp_path / "split") == output_files(tiny_store)


class CountingReads:
    """Every byte the reader reads from store files (its one read path)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = 0
        self.calls = 0
        real = store.read_into

        def counted(fd, offset, out, source=None):
            self.bytes += out.numel() * out.element_size()
            self.calls += 1
            return real(fd, offset, out, source)

        monkeypatch.setattr(store, "read_into", counted)


@pytest.mark.parametrize("ep_size,redundant", [(1, 0), (4, 4), (8, 0)])
def test_any_ranks_slots_read_from_the_store_are_its_per_rank_files_bytes(tiny_ckpt, tiny_store, tmp_path, ep_size,
                                                                        redundant, monkeypatch):
    ref = tmp_path / "ref"
    run_cli("convert", tiny_ckpt, ref, "--ep-size", ep_size, "--num-redundant-experts", redundant, "--experts-only")
    converted, placement = open_converted(tiny_store), Placement.default(8, ep_size, redundant)
    counter = CountingReads(monkeypatch)
    for rank in range(ep_size):
        want = load_rank(ref, rank)
        slots = {layer: placement.rank_logical_ids(rank) for layer in converted.manifest.layers}
        before = counter.bytes
        got = store.load_slots(converted, slots, starts={layer: placement.experts_start(rank) for layer in slots})
        assert got.keys() == want.keys()
        for prefix, layer in want.items():
            assert got[prefix].logical_ids == layer.logical_ids
            assert got[prefix].experts_start_idx == layer.experts_start_idx
            for key, t in layer.tensors.items():
                g = got[prefix].tensors[key]
                assert (g.dtype, g.shape, g.stride()) == (t.dtype, t.shape, t.stride()) and torch.equal(g, t), key
        # exactly the rank's slots' bytes (redundant slots re-read their expert) plus the per-layer tensors
        assert counter.bytes - before == sum(t.numel() * t.element_size() for layer in want.values()
                                            for t in layer.tensors.values())


def test_an_explicit_placement_reads_a_range_per_run_of_consecutive_experts(tiny_store, monkeypatch):
    converted = open_converted(tiny_store)
    layer = converted.manifest.layers[0]
    ids = (5, 6, 7, 0, 3, 3, 4)  # runs: 5-7 (wraps to 0: a new run), 3, 3-4
    assert store.slot_runs(ids) == [(0, 5, 3), (3, 0, 1), (4, 3, 1), (5, 3, 2)]
    counter = CountingReads(monkeypatch)
    got = store.load_slots(converted, {layer: ids})[layer.prefix]
    full = store.load_slots(converted, {layer: tuple(range(8))})[layer.prefix]
    for key in ("l1_weight", "l1_sf", "l2_weight", "l2_sf"):
        assert torch.equal(got.tensors[key], full.tensors[key][list(ids)]), key
    assert counter.calls == 4 * 4 + 4 + 8  # 4 runs x 4 routed tensors, 4 shared tensors; then the full read
    plan = store.rank_read_plan(converted.manifest, layer, ids)
    entries = store.check_store_file(tiny_store / "experts/layers.0.safetensors", converted.manifest, layer)
    assert [r.file_offset for r in plan if r.key == "l1_weight"] == [
        entries["l1_weight"].begin + logical * entries["l1_weight"].nbytes // 8 for logical in (5, 0, 3, 3)]


def test_bad_slots_and_a_tampered_store_are_refused_naming_the_file(tiny_store, tmp_path):
    converted = open_converted(tiny_store)
    layer = converted.manifest.layers[0]
    with pytest.raises(LoadError, match=r"layers.0: slots must hold logical experts 0..7"):
        store.load_slots(converted, {layer: (0, 8)})
    wrong = {"l1_weight": torch.empty(3, 1, 1, dtype=torch.int8)}
    with pytest.raises(LoadError, match=r"layers.0.ffn.experts: l1_weight destination is torch.int8\[3, 1, 1\]"):
        store.load_slots(converted, {layer: (0, 1)}, into={layer: wrong})
    with pytest.raises(LoadError, match="per-rank conversion"):
        from megamoe_convert.output.manifest import read_manifest
        store.load_slots(type(converted)(tiny_store, read_manifest(tiny_store).__class__(**{
            **read_manifest(tiny_store).__dict__, "store": False})), {layer: (0,)})
    path = tiny_store / "experts/layers.0.safetensors"
    data = bytearray(path.read_bytes())
    copy = tmp_path / "copy"
    import shutil
    shutil.copytree(tiny_store, copy)
    (copy / "experts/layers.0.safetensors").write_bytes(bytes(data[:-1]))
    with pytest.raises(LoadError, match=r"copy/experts/layers.0.safetensors: .*size"):
        store.load_slots(open_converted(copy), {layer: (0,)})
    assert safetensors_io.read_header(path).metadata["store"] == "logical-experts"


def _rewrite_header(path, edit) -> None:
    """Rewrite a store file's header JSON with ``edit`` (same length: the data stays where it is)."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    text = edit(json.loads(data[8:8 + n]))
    assert len(text) <= n
    data[8:8 + n] = text.encode().ljust(n)
    path.write_bytes(bytes(data))


def test_a_store_files_header_is_checked_byte_for_byte_else_parsed(tiny_store, tmp_path, monkeypatch):
    import shutil
    converted = open_converted(tiny_store)
    layer = converted.manifest.layers[0]
    path = tiny_store / "experts/layers.0.safetensors"
    with monkeypatch.context() as patched:  # the writer's own header: compared, not parsed
        patched.setattr(store, "read_header", lambda *_: pytest.fail("the writer's header was parsed"))
        fast = store.check_store_file(path, converted.manifest, layer)
    header = safetensors_io.read_header(path)
    assert {k: (e.name, e.dtype, e.shape, e.begin, e.end) for k, e in fast.items()} == {
        k: (header.tensors[e.name].name, header.tensors[e.name].dtype, header.tensors[e.name].shape,
            header.tensors[e.name].begin, header.tensors[e.name].end) for k, e in fast.items()}
    copy = tmp_path / "copy"
    shutil.copytree(tiny_store, copy)
    moved = copy / "experts/layers.0.safetensors"
    # The same header written another way (keys sorted): not the writer's bytes, parsed and accepted.
    _rewrite_header(moved, lambda h: json.dumps(h, separators=(",", ":"), sort_keys=True))
    assert moved.read_bytes() != path.read_bytes()
    want = store.load_slots(converted, {layer: (1, 0)})[layer.prefix].tensors
    got = store.load_slots(open_converted(copy), {layer: (1, 0)})[layer.prefix].tensors
    assert all(torch.equal(got[k], want[k]) for k in want)
    # Another layer's metadata in this layer's file: refused by the parse, naming the file.
    _rewrite_header(moved, lambda h: json.dumps({**h, "__metadata__": {**h["__metadata__"], "layer": "layers.9"}},
                                                separators=(",", ":")))
    with pytest.raises(LoadError, match=r"copy/experts/layers.0.safetensors: metadata .*layer=layers.9"):
        store.load_slots(open_converted(copy), {layer: (0,)})


def test_verify_checks_a_store_against_its_source_and_finds_a_flipped_byte(tiny_ckpt, tiny_store, tmp_path):
    report = json.loads(run_cli("verify", tiny_store, "--source", tiny_ckpt, "--numerics", "--json").stdout)
    assert report["ok"], report["problems"]
    assert report["checks"]["rank_shards"] == 3 and report["checks"]["expert_slots_vs_source"] == 3 * 8
    assert report["numerics"]["max_abs_err"] == 0.0 and report["numerics"]["layers"] == 3
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(tiny_store, copy)
    path = copy / "experts/layers.1.safetensors"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    proc = run_cli("verify", copy, "--json", check=False)
    assert proc.returncode != 0
    problems = json.loads(proc.stdout)["problems"]
    assert len(problems) == 1 and problems[0].startswith("experts/layers.1.safetensors: ") and "checksum" in problems[0]
    (copy / "experts/layers.9.safetensors").write_bytes(b"x")
    problems = json.loads(run_cli("verify", copy, "--json", check=False).stdout)["problems"]
    assert any(p.startswith("experts/layers.9.safetensors: not listed") for p in problems)


@pytest.mark.parametrize("command,extra", [("inspect", ()), ("plan", ("--engine", "sglang"))])
def test_inspect_and_plan_on_a_store_show_what_each_rank_reads(tiny_store, command, extra, monkeypatch):
    data = json.loads(run_cli(command, tiny_store, "--ep-size", 4, "--num-redundant-experts", 4, *extra,
                              "--json").stdout)
    if command == "inspect":  # what the store is (as for any output), and what each rank reads of it
        assert data["kind"] == "store" and data["serve"]["vllm"]["servable"]
        data = data["reads"]
    assert data["ep_size"] == 4 and data["num_redundant"] == 4 and len(data["ranks"]) == 4
    converted = open_converted(tiny_store)
    assert data["store_expert_bytes"] == sum(f.size for f in converted.manifest.files if f.path.startswith("experts/"))
    counter = CountingReads(monkeypatch)
    from megamoe_convert.layout.placement import layer_placement
    engine = "sglang" if extra else "vllm"
    for rank, row in enumerate(data["ranks"]):
        placements = {layer: layer_placement(engine, Placement.default(8, 4, 4), layer.is_mtp, 8)
                      for layer in converted.manifest.layers}
        before, calls = counter.bytes, counter.calls
        store.load_slots(converted, {layer: p.rank_logical_ids(rank) for layer, p in placements.items()})
        assert row["read_bytes"] == counter.bytes - before and row["reads"] == counter.calls - calls
        assert row["range_bytes"] <= row["read_bytes"] and len(row["per_layer"]) == len(data["layer_groups"])
    groups = {tuple(g["layers"]): g for g in data["layer_groups"]}
    if extra:  # SGLang builds the MTP layer without redundant experts: 2 slots a rank, not 3
        assert groups[("mtp.0",)]["experts_per_rank"] == 2 and groups[("layers.0", "layers.1")]["experts_per_rank"] == 3
        decoder, mtp = (data["ranks"][0]["per_layer"][list(groups).index(k)] for k in (("layers.0", "layers.1"),
                                                                                       ("mtp.0",)))
        assert mtp["range_bytes"] < decoder["range_bytes"]
    else:  # vLLM: every layer alike, worked out once
        assert list(groups) == [("layers.0", "layers.1", "mtp.0")]
    text = " ".join(run_cli(command, tiny_store, "--ep-size", 8).stdout.split())
    assert "what each rank of EP 8 (0 redundant" in text and "distinct ranges" in text


@pytest.mark.parametrize("weight_format", ["nvfp4", "mxfp8"])
def test_a_store_of_another_weight_format_serves_any_ranks_slots_with_its_extras(tmp_path, weight_format):
    """NVFP4's per-expert global scales follow the slots; its every-expert input scales are per layer."""
    src = tmp_path / "src"
    run_cli("synth", src, "--format", weight_format, "--experts", 4, "--layers", 1, "--mtp-layers", 0)
    run_cli("convert", src, tmp_path / "store", "--experts-only")
    run_cli("convert", src, tmp_path / "ep2", "--ep-size", 2, "--num-redundant-experts", 2, "--experts-only")
    converted, placement = open_converted(tmp_path / "store"), Placement.default(4, 2, 2)
    for rank in range(2):
        want = load_rank(tmp_path / "ep2", rank)
        got = store.load_slots(converted,
                               {layer: placement.rank_logical_ids(rank) for layer in converted.manifest.layers})
        for prefix, layer in want.items():
            assert set(got[prefix].tensors) == set(layer.tensors)
            for key, t in layer.tensors.items():
                assert torch.equal(got[prefix].tensors[key], t), (rank, key)
    if weight_format == "nvfp4":
        assert {"l1_global_scale", "l2_input_scale", "l2_input_scale_all"} <= set(layer.tensors)
