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
from megamoe_convert.output.manifest import read_manifest
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


def test_a_manifest_without_a_layout_identity_is_refused_in_one_line(converted, tmp_path):
    """Every manifest this code writes records one: a manifest without is no conversion of it."""
    copy = _resealed(converted, tmp_path, lambda data: data.pop("layout"))
    with pytest.raises(ManifestError, match=r"manifest\.json: missing field 'layout'$"):
        read_manifest(copy)
    proc = run_cli("inspect", copy, check=False)
    assert proc.returncode == 2 and "missing field 'layout'" in proc.stderr and not proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    report = json.loads(run_cli("verify", copy, "--json", check=False).stdout)
    assert not report["ok"] and any("missing field 'layout'" in str(p) for p in report["problems"])


@pytest.mark.parametrize("edit", [
    lambda layout: layout.update(input="pcg64-raw/0"),
    lambda layout: layout.update(seed=identity.PROBE_SEED + 1),
])
def test_an_identity_of_another_probe_input_is_refused(converted, tmp_path, edit):
    """Its fingerprints are of another input, so they say nothing of this package's layout: the
    manifest is refused, naming the field and this package's input, rather than served unchecked."""
    copy = _resealed(converted, tmp_path, lambda data: edit(data["layout"]))
    with pytest.raises(ManifestError) as refused:
        read_manifest(copy)
    message = str(refused.value)
    assert message.startswith(f"{copy / 'manifest.json'}: layout identity of another probe input")
    assert f"{identity.PROBE_INPUT!r}, seed {identity.PROBE_SEED}" in message and "convert again" in message
    assert "\n" not in message
    proc = run_cli("inspect", copy, check=False)
    assert proc.returncode == 2 and "layout identity of another probe input" in proc.stderr and not proc.stdout


@pytest.mark.parametrize("edit,field", [
    (lambda d: d["layout"]["fingerprints"].update(routed="xxh3_64:not-hex"), "layout.fingerprints.routed"),
    (lambda d: d["layout"]["fingerprints"].pop("routed"), "layout.fingerprints.routed"),
    (lambda d: d["layout"].update(seed="7"), "layout.seed"),
    (lambda d: d["layout"].update(input=3), "layout.input"),
    (lambda d: d["layout"].pop("input"), "layout.input"),
    (lambda d: d["layout"].pop("proven"), "layout.proven"),
    (lambda d: d.update(layout=[]), "layout"),
])
def test_a_malformed_layout_record_is_refused_naming_its_field(converted, tmp_path, edit, field):
    copy = _resealed(converted, tmp_path, edit)
    with pytest.raises(ManifestError, match=field.replace(".", r"\.")):
        read_manifest(copy)
