"""One conversion on many machines: ``convert --shard I/N`` and ``megamoe merge``.

The reference is a single-machine ``megamoe convert`` of the same checkpoint
(``tiny_converted``: EP 4, 4 redundant experts): parts + merge must give the same files,
byte for byte, whether the parts ran into separate directories or into one shared one.
"""

from __future__ import annotations

import json
import shutil
import threading

import pytest
from conftest import output_files, run_cli

from megamoe_convert.convert.fleet import MergeError, merge
from megamoe_convert.convert.plan import ConvertOptions, parse_shard
from megamoe_convert.convert.run import build_plan, convert
from megamoe_convert.errors import ConvertError
from megamoe_convert.source.safetensors_io import FileCache

EP4 = ("--ep-size", 4, "--num-redundant-experts", 4)


def options(shard: tuple[int, int] | None = None, by: str = "layer", **kw: object) -> ConvertOptions:
    return ConvertOptions(ep_size=4, num_redundant_experts=4, shard=shard, shard_by=by, fsync=False, **kw)


# ----------------------------------------------------------------------------- the split itself

@pytest.mark.parametrize("by", ["layer", "rank"])
@pytest.mark.parametrize("count", [1, 2, 3, 4, 7])
def test_every_file_is_in_exactly_one_part_whatever_n(tiny_ckpt, tmp_path, by, count):
    def paths(shard):
        with FileCache() as files:
            plan = build_plan(tiny_ckpt, tmp_path, options(shard, by), files, threading.Event())
            return [u.path for u in plan.units], plan.all_paths

    whole, _ = paths(None)
    seen: list[str] = []
    for i in range(count):
        mine, all_paths = paths((i, count))
        assert all_paths == whole
        assert mine == paths((i, count))[0]  # deterministic
        seen += mine
    assert sorted(seen) == sorted(whole)
    assert len(set(seen)) == len(seen)


def test_layer_split_gives_each_part_whole_layers(tiny_ckpt, tmp_path):
    with FileCache() as files:
        plan = build_plan(tiny_ckpt, tmp_path, options((1, 3)), files, threading.Event())
    assert {u.layer.key for u in plan.units if u.kind == "experts"} == {"layers.1"}
    assert {u.rank for u in plan.units if u.kind == "experts"} == {0, 1, 2, 3}


@pytest.mark.parametrize("spec", ["3/3", "-1/2", "1", "a/b", "0/0", "1/2/3"])
def test_bad_shard_specs_are_refused(spec):
    with pytest.raises(ConvertError, match="--shard"):
        parse_shard(spec)


# ----------------------------------------------------------------------------- merge checks

@pytest.fixture()
def three_parts(tiny_ckpt, tmp_path):
    parts = [tmp_path / f"p{i}" for i in range(3)]
    for i, part in enumerate(parts):
        convert(tiny_ckpt, part, options((i, 3)))
    return parts


def test_merge_refuses_missing_or_foreign_parts(tiny_ckpt, tmp_path, three_parts):
    with pytest.raises(MergeError, match=r"1 of 3 parts missing \(part 2 not found"):
        merge(tmp_path / "out", three_parts[:2])
    other = tmp_path / "ep2"
    convert(tiny_ckpt, other, ConvertOptions(ep_size=2, shard=(2, 3), fsync=False))
    with pytest.raises(MergeError, match="different conversions"):
        merge(tmp_path / "out", [*three_parts[:2], other])
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConvertError, match="not a megamoe output"):
        merge(foreign, three_parts)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_parts_converted_from_different_hub_revisions_are_not_merged(tiny_ckpt, tmp_path):
    """Pods that download an unpinned repo at different times may get different commits: their
    parts are different plans, so merge refuses to mix them into one manifest."""
    snapshots = tmp_path / "hf" / "models--deepseek-ai--tiny" / "snapshots"
    for commit in ("a" * 40, "b" * 40):
        shutil.copytree(tiny_ckpt, snapshots / commit)
    for index, commit in enumerate(("a" * 40, "b" * 40)):
        run_cli("convert", snapshots / commit, tmp_path / f"part{index}", "--ep-size", 2, "--shard", f"{index}/2",
                "--no-fsync")
    proc = run_cli("merge", tmp_path / "out", tmp_path / "part0", tmp_path / "part1", check=False)
    assert proc.returncode == 2 and "different conversions found (source_revision differ)" in proc.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()
    manifest = json.loads((tmp_path / "part0" / "manifest.part-00000-of-00002.json").read_text())
    assert manifest["fingerprint"]["source_revision"] == "a" * 40


@pytest.mark.parametrize("edit,expected", [
    (lambda d: d.pop("source_sample"), "missing field 'source_sample'"),
    (lambda d: d.pop("source_stamp"), "missing field 'source_stamp'"),
    (lambda d: d.update(source_sample=[]), "source_sample must be an object"),
    (lambda d: d.update(format_version=0), "part format_version 0 is not 1"),
    (lambda d: d.update(format_version=2), "part format_version 2 is not 1"),
])
def test_a_part_manifest_without_what_every_part_records_is_refused(tmp_path, three_parts, edit, expected):
    """Every part records its source's stamps and sampled bytes (merge checks one source by them):
    a part manifest without them is no part this code wrote, refused in one line naming it."""
    path = three_parts[1] / "manifest.part-00001-of-00003.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    proc = run_cli("merge", tmp_path / "out", *three_parts, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert f"{path}: " in proc.stderr and expected in proc.stderr, proc.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_merge_rechecks_sizes_and_checksums(tmp_path, three_parts):
    victim = next((three_parts[2] / "rank-00001-of-00004").glob("*.safetensors"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))  # same size, different bytes
    with pytest.raises(MergeError, match="checksum mismatch"):
        merge(tmp_path / "out", three_parts)
    victim.write_bytes(bytes(data[:-1]))
    with pytest.raises(MergeError, match="size"):
        merge(tmp_path / "out", three_parts, verify=False)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_merge_into_one_of_the_parts_and_again(tiny_converted, three_parts):
    own = len(json.loads((three_parts[0] / "manifest.part-00000-of-00003.json").read_text())["files"])
    first = merge(three_parts[0], three_parts[1:])
    assert first["in_place"] == own and first["linked"] + first["copied"] == 15 - own > 0
    assert output_files(three_parts[0]) == output_files(tiny_converted)
    again = merge(three_parts[0], three_parts[1:])  # repeatable: the consumed part manifest is kept
    assert again["in_place"] + again["present"] == 15
    assert output_files(three_parts[0]) == output_files(tiny_converted)


def test_a_part_refuses_an_output_holding_a_different_conversion(tiny_ckpt, tiny_converted, tmp_path):
    out = tmp_path / "ep2"
    convert(tiny_ckpt, out, ConvertOptions(ep_size=2, fsync=False))
    with pytest.raises(ConvertError, match="different options"):
        convert(tiny_ckpt, out, options((0, 2)))
    assert (out / "manifest.json").exists()  # refused before touching anything


def test_parts_replacing_a_full_conversion_leave_nothing_of_it_after_merge(tiny_ckpt, tmp_path):
    """Full conversion, then ``--experts-only --overwrite`` parts into the same directory and a
    merge: the old index and non-expert shards go (nothing lists them any more); user files stay."""
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    run_cli("convert", tiny_ckpt, out, *EP4, "--no-fsync")
    (out / "NOTES.md").write_text("mine")
    for i in range(2):
        run_cli("convert", tiny_ckpt, out, *EP4, "--experts-only", "--overwrite", "--shard", f"{i}/2",
                "--shard-by", "rank", "--no-fsync")
    run_cli("merge", out)
    run_cli("convert", tiny_ckpt, fresh, *EP4, "--experts-only", "--no-fsync")
    assert output_files(out) == output_files(fresh) | {"NOTES.md": b"mine"}


def test_single_part_merges_itself_and_can_still_be_merged_elsewhere(tiny_ckpt, tiny_converted, tmp_path):
    summary = convert(tiny_ckpt, tmp_path / "p0", options((0, 1)))
    assert summary.merged
    assert output_files(tmp_path / "p0") == output_files(tiny_converted)
    merge(tmp_path / "copy", [tmp_path / "p0"])
    assert output_files(tmp_path / "copy") == output_files(tiny_converted)
