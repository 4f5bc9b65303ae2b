"""The layout identity a conversion records (``output/layout_identity.py``): the manifest holds it,
``megamoe inspect`` shows it, ``megamoe verify`` checks it against what this package writes, and a
malformed record is refused naming its field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from megamoe_convert.errors import ManifestError
from megamoe_convert.layout import identity
from megamoe_convert.output.manifest import Manifest, read_manifest
from megamoe_convert.output.seal import seal
from megamoe_convert.source import formats


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset (with its fused shared expert) through the CLI, EP 2. Read-only: tests copy."""
    root = tmp_path_factory.mktemp("identity")
    run_cli("synth", root / "src", "--experts", 4, "--layers", 1, "--mtp-layers", 0)
    run_cli("convert", root / "src", root / "out", "--ep-size", 2)
    return root / "out"


def _resealed(out: Path, tmp_path: Path, edit) -> Path:
    """A copy of ``out`` whose manifest was edited by ``edit`` and sealed again, so only the layout
    checks can tell."""
    copy = tmp_path / "copy"
    for path in out.rglob("*"):
        if path.is_file():
            target = copy / path.relative_to(out)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    data = json.loads((copy / "manifest.json").read_text())
    data.pop("manifest_checksum")
    edit(data)
    (copy / "manifest.json").write_text(seal(data))
    return copy


def test_a_conversion_records_the_identity_of_the_layout_it_wrote(converted):
    data = json.loads((converted / "manifest.json").read_text())
    dims = read_manifest(converted).dims
    assert dims.shared_intermediate_size  # the routed and the shared fingerprint both
    want = identity.layout_identity(formats.FORMATS[dims.weight_format], dims.hidden_size, dims.moe_intermediate_size,
                                    dims.shared_intermediate_size)
    assert data["layout"] == want and set(want["fingerprints"]) == {"routed", "shared"}
    assert want["transform"] == identity.TRANSFORMS["sm100"] and want["seed"] == identity.PROBE_SEED
    assert read_manifest(converted).layout == want


def test_inspect_shows_the_layout_identity(converted):
    record = json.loads((converted / "manifest.json").read_text())["layout"]
    shown = json.loads(run_cli("inspect", converted, "--json").stdout)
    assert shown["layout"] == record
    text = run_cli("inspect", converted).stdout
    assert "layout identity" in text and record["fingerprints"]["routed"] in text and record["transform"] in text


def test_verify_checks_the_layout_identity(converted):
    report = json.loads(run_cli("verify", converted, "--json").stdout)
    assert report["ok"] and report["checks"]["layout_identity"] == 1 and "layout identity" not in report["skipped"]


@pytest.mark.parametrize("field,value,problem", [
    ("fingerprints", {"routed": "xxh3_64:0123456789abcdef", "shared": None},
     "layout.fingerprints.routed is xxh3_64:0123456789abcdef"),
    ("transform", "deepgemm-sm100-mega-moe/0", "layout.transform is 'deepgemm-sm100-mega-moe/0'"),
])
def test_verify_refuses_experts_written_with_another_layout(converted, tmp_path, field, value, problem):
    def edit(data):
        if field == "fingerprints":
            data["layout"]["fingerprints"]["routed"] = value["routed"]
        else:
            data["layout"][field] = value

    copy = _resealed(converted, tmp_path, edit)
    proc = run_cli("verify", copy, check=False)
    assert proc.returncode == 1 and problem in proc.stdout, proc.stdout + proc.stderr
    assert "convert again" in proc.stdout


def test_a_manifest_without_a_layout_identity_reads_and_verify_says_it_was_not_checked(converted, tmp_path):
    copy = _resealed(converted, tmp_path, lambda data: data.pop("layout"))
    assert read_manifest(copy).layout is None
    report = json.loads(run_cli("verify", copy, "--json").stdout)
    assert report["ok"] and report["skipped"]["layout identity"] == identity.NOT_RECORDED
    assert "not recorded" in run_cli("inspect", copy).stdout


def test_an_identity_of_an_older_probe_input_is_not_compared_and_verify_says_so(converted, tmp_path):
    """A record without ``input`` (an older megamoe-convert's generator) keeps its transform checked;
    its fingerprints, of another input, are neither compared nor mistaken for another layout."""
    def older(data):
        data["layout"].pop("input")
        data["layout"]["fingerprints"] = {"routed": "xxh3_64:0123456789abcdef"}

    copy = _resealed(converted, tmp_path, older)
    record = read_manifest(copy).layout
    assert "input" not in record and identity.comparable_fingerprints(record) is None
    # written again as read (merge rebuilds a manifest from its parts' records): it reads back the same
    manifest = read_manifest(copy)
    assert Manifest.from_json(json.loads(manifest.dumps()), sealed=False).layout == record
    report = json.loads(run_cli("verify", copy, "--json").stdout)
    assert report["ok"] and "layout_identity" not in report["checks"]
    assert report["skipped"]["layout identity"] == identity.OTHER_INPUT
    swapped = _resealed(converted, tmp_path / "b", lambda d: (older(d), d["layout"].update(transform="x/0")))
    assert "layout.transform is 'x/0'" in run_cli("verify", swapped, check=False).stdout


@pytest.mark.parametrize("edit,field", [
    (lambda d: d["layout"]["fingerprints"].update(routed="xxh3_64:not-hex"), "layout.fingerprints.routed"),
    (lambda d: d["layout"]["fingerprints"].pop("routed"), "layout.fingerprints.routed"),
    (lambda d: d["layout"].update(seed="7"), "layout.seed"),
    (lambda d: d["layout"].update(input=3), "layout.input"),
    (lambda d: d.update(layout=[]), "layout"),
])
def test_a_malformed_layout_record_is_refused_naming_its_field(converted, tmp_path, edit, field):
    copy = _resealed(converted, tmp_path, edit)
    with pytest.raises(ManifestError, match=field.replace(".", r"\.")):
        read_manifest(copy)
