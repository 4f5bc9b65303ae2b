"""``merge`` checks the disk before it starts, as ``convert`` does: what it would copy (parts on another
filesystem) must fit, in one line naming OUT, with nothing merged; hard links on the parts' own
filesystem take no space, so such a merge goes ahead on a nearly full disk."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
from conftest import output_files

from megamoe_convert import faults
from megamoe_convert.convert.fleet import merge
from megamoe_convert.convert.plan import ConvertOptions
from megamoe_convert.convert.run import convert
from megamoe_convert.errors import MergeError
from megamoe_convert.output.preflight import HEADROOM_BYTES

#: A disk with room for the headroom every check keeps and one byte more: no file of the plan fits.
NEARLY_FULL = HEADROOM_BYTES + 1
SHM = Path("/dev/shm")


def convert_parts(src: Path, root: Path) -> list[Path]:
    """The tiny preset's layer 0, EP 2, as two parts in their own folders below ``root``."""
    parts = []
    for index in range(2):
        part = root / f"part{index}"
        convert(src, part, ConvertOptions(ep_size=2, layers="0", shard=(index, 2), fsync=False))
        parts.append(part)
    return parts


@pytest.fixture
def other_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A folder on another filesystem than ``tmp_path`` (a RAM disk), or the test is skipped."""
    if not SHM.is_dir() or os.stat(SHM).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem (/dev/shm) beside the temporary folder")
    folder = Path(tempfile.mkdtemp(dir=SHM, prefix="megamoe-merge-"))
    yield folder
    shutil.rmtree(folder)


def test_a_merge_that_would_copy_more_than_fits_is_refused_before_it_starts(tiny_ckpt, tmp_path, other_filesystem,
                                                                            monkeypatch):
    parts = convert_parts(tiny_ckpt, other_filesystem)
    out = tmp_path / "out"
    monkeypatch.setattr(faults, "free_bytes", lambda actual: NEARLY_FULL)
    with pytest.raises(MergeError) as refused:
        merge(out, parts, fsync=False)
    message = str(refused.value)
    assert message.startswith(f"{out}: this merge needs ") and " needs 0 B " not in message
    assert "free space, or merge on the filesystem" in message
    assert "nothing was written" in message and "\n" not in message
    assert output_files(out) == {}, "a refused merge brought files into OUT"
    monkeypatch.undo()
    assert merge(out, parts, fsync=False)["copied"] > 0  # room again: the same command merges


def test_hard_links_take_no_space_so_a_merge_on_the_parts_filesystem_goes_ahead(tiny_ckpt, tmp_path, monkeypatch):
    parts = convert_parts(tiny_ckpt, tmp_path)
    monkeypatch.setattr(faults, "free_bytes", lambda actual: NEARLY_FULL)
    summary = merge(tmp_path / "out", parts, fsync=False)
    assert summary["linked"] == summary["files"] and summary["copied"] == 0
    assert (tmp_path / "out" / "manifest.json").is_file()
