"""The layout identity travels with the bytes: ``load_rank`` (and so every install and ``load_slots``)
refuses a conversion whose manifest names a transform this package does not write for its experts,
or none, before any byte of it is read. The fingerprints are the engines' probe's and verify's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from megamoe_convert.convert.plan import ConvertOptions
from megamoe_convert.convert.run import convert
from megamoe_convert.errors import LoadError, ManifestError
from megamoe_convert.layout import identity
from megamoe_convert.output.seal import seal
from megamoe_convert.serve.loader import load_rank, open_converted
from megamoe_convert.serve.store import load_slots
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.verify import verify

SM100, SM90 = identity.TRANSFORMS["sm100"], identity.TRANSFORMS["sm90"]


@pytest.fixture(scope="module")
def conversions(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny preset's layer 0 as EP 2 rank files and as a store. Read-only: tests copy."""
    root = tmp_path_factory.mktemp("identity-load")
    convert(tiny_ckpt, root / "ep2", ConvertOptions(ep_size=2, layers="0", fsync=False))
    convert(tiny_ckpt, root / "store", ConvertOptions(ep_size=None, layers="0", fsync=False))
    return {"ep2": root / "ep2", "store": root / "store"}


def resealed(out: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], None], keep_bytes: bool = False) -> Path:
    """A copy of ``out`` whose manifest ``edit`` changed and that was sealed again (only the layout
    checks can tell); without ``keep_bytes`` its expert files are gone, so a load that reads any
    byte of them fails otherwise."""
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    if not keep_bytes:
        for shard in [*copy.glob("rank-*/*.safetensors"), *copy.glob("experts/*.safetensors")]:
            shard.unlink()
    data = json.loads((copy / "manifest.json").read_text())
    data.pop("manifest_checksum")
    edit(data)
    (copy / "manifest.json").write_text(seal(data))
    return copy


def set_transform(name: str) -> Callable[[dict[str, Any]], None]:
    return lambda data: data["layout"].update(transform=name)


def test_the_conversions_load_with_the_transform_they_record(conversions):
    assert open_converted(conversions["ep2"]).manifest.layout["transform"] == SM100
    assert set(load_rank(conversions["ep2"], 1)) == {"layers.0.ffn.experts"}
    assert set(load_rank(conversions["store"], 1, ep_size=2)) == {"layers.0.ffn.experts"}


@pytest.mark.parametrize("transform", ["deepgemm-sm100-mega-moe/0", "someone-elses-layout/3", SM90])
def test_a_transform_this_package_does_not_write_for_the_format_is_refused_before_any_byte(conversions, tmp_path,
                                                                                         transform):
    """An older or foreign transform name, or SM90's on SM100 experts: one line, naming the manifest,
    the field and what this package writes; the deleted expert files are never reached."""
    copy = resealed(conversions["ep2"], tmp_path, set_transform(transform))
    with pytest.raises(LoadError) as refused:
        load_rank(copy, 0)
    message = str(refused.value)
    assert message.startswith(f"{copy / 'manifest.json'}: layout.transform is {transform!r}, but this "
                              f"megamoe-convert writes mxfp4 experts as {SM100!r}")
    assert "\n" not in message and "convert again" in message


def test_a_store_with_a_foreign_transform_is_refused_for_every_placement(conversions, tmp_path):
    copy = resealed(conversions["store"], tmp_path, set_transform("someone-elses-layout/3"))
    with pytest.raises(LoadError, match=r"layout\.transform is 'someone-elses-layout/3'"):
        load_rank(copy, 0, ep_size=2)
    with pytest.raises(LoadError, match=r"layout\.transform is 'someone-elses-layout/3'"):
        load_slots(open_converted(copy), {MoELayer(False, 0): [3, 1]})


def test_a_manifest_without_a_layout_identity_is_refused(conversions, tmp_path):
    copy = resealed(conversions["ep2"], tmp_path, lambda data: data.pop("layout"))
    with pytest.raises(ManifestError, match=r"manifest\.json: missing field 'layout'$"):
        load_rank(copy, 1)


def test_other_fingerprints_load_and_verify_catches_them(conversions, tmp_path):
    """The fingerprints describe the probe expert's layout: the engines' probe compares them with the
    engine's own code at install, verify recomputes them; the loader leaves them to both."""
    def edit(data: dict[str, Any]) -> None:
        data["layout"]["fingerprints"]["routed"] = "xxh3_64:0123456789abcdef"

    copy = resealed(conversions["ep2"], tmp_path, edit, keep_bytes=True)
    assert set(load_rank(copy, 0)) == {"layers.0.ffn.experts"}
    report = verify(copy)
    assert not report.ok and any("layout.fingerprints.routed is xxh3_64:0123456789abcdef" in str(p)
                                 for p in report.problems)
