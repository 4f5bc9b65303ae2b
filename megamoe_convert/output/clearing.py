"""The only code that deletes anything in OUT, and the rules it keeps.

A file is deleted only where the journal (or a manifest) records it, its path fits the tool's
naming scheme (:func:`naming.is_own_path`: never in the user's folders, such as SGLang's
presharded dump), it resolves inside OUT without passing a symbolic link
(:func:`naming.owned_path`), and it still has its recorded size (a small copied file also its
checksum): whatever else lies in OUT, or has changed since the tool wrote it, is someone else's
and stays. Top-level result files (manifest, index, part manifests) go by their exact names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from megamoe_convert.output import ranged
from megamoe_convert.output.journal import JOURNAL_NAME, REPLACED_JOURNAL, read_journals
from megamoe_convert.output.naming import (
    MANIFEST_NAME,
    MERGED_PARTS_DIR,
    PART_GLOB,
    RANK_DIR,
    STATE_DIR,
    is_part_manifest,
    is_shard_path,
    owned_path,
)
from megamoe_convert.output.writer import PARTIAL_SUFFIX, FileRecord, file_checksum, partial_path
from megamoe_convert.source.checkpoint import INDEX_NAME


def remove_owned(out: Path, records: Iterable[FileRecord]) -> None:
    """Delete the files of ``records`` that are still what the tool wrote (see module doc),
    then the rank folders left empty."""
    dirs = set()
    for record in records:
        path = owned_path(out, record.path)
        if path is None or not path.is_file() or path.is_symlink():
            continue
        if path.stat().st_size != record.size or (not is_shard_path(record.path)
                                                  and file_checksum(path) != record.checksum):
            continue  # not the bytes the tool wrote there: someone else's now
        path.unlink()
        dirs.add(path.parent)
    for folder in dirs:
        if RANK_DIR.fullmatch(folder.name) and folder.parent == out and not any(folder.iterdir()):
            folder.rmdir()


def remove_named(out: Path, names: Iterable[str]) -> None:
    """Delete the tool's own top-level result files (manifest, index, part manifests) by name."""
    for name in names:
        if name in (MANIFEST_NAME, INDEX_NAME) or is_part_manifest(name):
            (out / name).unlink(missing_ok=True)


def remove_results(out: Path, journal: dict[str, FileRecord]) -> None:
    """Everything a whole conversion (or merge) wrote: the manifest, index and part manifests,
    the journaled files, and the part manifests a merge consumed."""
    remove_named(out, [MANIFEST_NAME, INDEX_NAME, *(p.name for p in out.glob(PART_GLOB))])
    remove_owned(out, journal.values())
    merged = out / MERGED_PARTS_DIR
    if merged.is_dir() and not merged.is_symlink():
        remove_named(merged, [p.name for p in merged.glob(PART_GLOB)])
        if not any(merged.iterdir()):
            merged.rmdir()


def remove_partials(out: Path, paths: Iterable[str] | None = None) -> None:
    """The tool's own temporary files (``.NAME.partial``): of ``paths`` only (a part's, while other
    parts may be writing theirs), or all of them at the top of OUT and in its rank folders."""
    if paths is not None:
        for rel in paths:
            if (path := owned_path(out, rel)) is not None:
                partial_path(path).unlink(missing_ok=True)
        return
    for folder in [out, *(d for d in out.iterdir() if RANK_DIR.fullmatch(d.name) and d.is_dir()
                          and not d.is_symlink())]:
        for path in folder.glob(f".*{PARTIAL_SUFFIX}"):
            path.unlink(missing_ok=True)


def forget_replaced_conversion(out: Path, new_paths: set[str], has_index: bool) -> None:
    """Delete what the whole conversion in ``out`` before this merge wrote and this one does not
    (e.g. a full conversion replaced by ``--experts-only`` parts): the non-expert shards, the index.
    Only journaled files go (:func:`remove_owned`); anything else in ``out`` is left alone."""
    previous = read_journals(out, REPLACED_JOURNAL, JOURNAL_NAME)
    remove_owned(out, [record for path, record in previous.items() if path not in new_paths])
    if not has_index:
        remove_named(out, [INDEX_NAME])
    (out / STATE_DIR / REPLACED_JOURNAL).unlink(missing_ok=True)
    forget_ranged_pull(out)


def forget_ranged_pull(out: Path) -> None:
    """For whatever rewrites OUT over a ranged pull (:mod:`.ranged`): its manifest goes first (nothing
    is served meanwhile), then its record; the sparse store files are the writer's to replace, and
    any it does not are no longer listed."""
    if os.path.lexists(ranged.record_path(out)):
        (out / MANIFEST_NAME).unlink(missing_ok=True)
        ranged.record_path(out).unlink()
