"""Shared by the tests that damage a conversion or its source and read the refusal: tiny sources
of three kinds and their conversions (fixtures: a pytest plugin, ``pytest_plugins`` in conftest.py),
and ways to edit files and reseal a manifest (imported by name)."""

from __future__ import annotations

import json
import shutil
import struct
import sys
import time
from pathlib import Path

import pytest
from conftest import output_files, run_cli

from megamoe_convert.output.seal import seal
from megamoe_convert.output.writer import file_checksum
from megamoe_convert.source.safetensors_io import read_header
from megamoe_convert.synth import synthesize

EP2 = ("--ep-size", 2, "--no-fsync")
RANK0 = "rank-00000-of-00002"
#: The conversion the crash, concurrency and fault tests interrupt and compare with an uninterrupted run.
CONVERT_ARGS = ("--ep-size", 2, "--num-redundant-experts", 2, "--workers", 2, "--no-fsync")


@pytest.fixture(scope="module")
def clean(tiny_ckpt, tmp_path_factory) -> tuple[dict[str, bytes], float]:
    """The files of an uninterrupted ``CONVERT_ARGS`` conversion, and how long it took."""
    out = tmp_path_factory.mktemp("clean") / "out"
    started = time.perf_counter()
    run_cli("convert", tiny_ckpt, out, *CONVERT_ARGS)
    return output_files(out), time.perf_counter() - started


def cli_cmd(*args: object) -> list[str]:
    """``megamoe ARGS`` as a command line for a process of its own."""
    return [sys.executable, "-m", "megamoe_convert.cli", *map(str, args)]

def one_line_refusal(proc, *needles: str) -> None:
    """Exit 2, and on stderr exactly one line ``error: ...`` holding every needle."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("error: ") and all(n in proc.stderr for n in needles), proc.stderr


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """tiny (MXFP4 + fused shared expert), a one-layer NVFP4 tiny, and DeepSeek-V4.1 tiny."""
    root = tmp_path_factory.mktemp("sources")
    kinds = {"mx": dict(preset="tiny"), "v41": dict(preset="v4.1-tiny"),
             "nv": dict(preset="tiny", experts=4, layers=1, mtp_layers=0, weight_format="nvfp4")}
    for name, kw in kinds.items():
        synthesize(root / name, seed=1, **kw)
    return {name: root / name for name in kinds}


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("converted")
    for name, src in sources.items():
        run_cli("convert", src, root / name, *EP2)
    return {name: root / name for name in sources}


def copy(path: Path, tmp_path: Path, name: str = "out") -> Path:
    shutil.copytree(path, tmp_path / name, symlinks=True)
    return tmp_path / name


def reseal(out: Path, edit=None) -> None:
    """Recompute every listed file's size and checksum and the manifest's seal (``edit``: change
    the manifest's fields first): only a comparison with the source can then tell."""
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.pop("manifest_checksum", None)
    for item in manifest["files"]:
        path = out / item["path"]
        item["size"], item["checksum"] = path.stat().st_size, file_checksum(path)
    if edit:
        edit(manifest)
    (out / "manifest.json").write_text(seal(manifest))


def poke(path: Path, tensor: str, data: bytes) -> None:
    """Overwrite the first bytes of ``tensor`` in a safetensors file, in place."""
    entry = read_header(path).tensors[tensor]
    assert len(data) <= entry.nbytes
    with open(path, "r+b") as f:
        f.seek(entry.begin)
        f.write(data)


def f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def problems(proc) -> list[str]:
    return [line.strip()[2:] for line in proc.stdout.splitlines() if line.strip().startswith("- ")]
