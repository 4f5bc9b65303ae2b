"""Resuming a conversion into OUT: whether OUT may be written at all, and whether what is already
there may be reused.

``convert`` and ``merge`` use one interface, :class:`OutputState` (``OUT/.megamoe/``: the plan
fingerprint, the source stamp, the journal), or :class:`PartState` for one part of a split
conversion (``OUT/.megamoe/part-I-of-N/``):

* :meth:`OutputState.locked`: who may write OUT at once (``locks``);
* :meth:`OutputState.prepare`: refuse a differently-planned or stale OUT before touching it, or
  clear it with ``--overwrite``;
* :meth:`OutputState.record` / :meth:`OutputState.journal`: what was written (``journal``);
* :meth:`OutputState.clear`: delete what this tool wrote, nothing else (``clearing``).

A state file that is damaged is read as absent or different, never trusted.
"""

from __future__ import annotations

import json
import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from megamoe_convert import faults, jsonio
from megamoe_convert.errors import ConvertError, JsonError
from megamoe_convert.output import clearing
from megamoe_convert.output.journal import JOURNAL_NAME, REPLACED_JOURNAL, JournalWriter, read_journal
from megamoe_convert.output.locks import hold_part, hold_whole_output
from megamoe_convert.output.naming import MERGED_PARTS_DIR, STATE_DIR, format_ranges, part_manifest_name, part_name
from megamoe_convert.output.writer import FileRecord, write_json_atomic

#: The key of ``.megamoe/source.json`` that holds the source directory itself (no file of it is named
#: ``.``): the SRC an unfinished conversion's resume hint names. Not compared between runs: the files'
#: stamps say whether the source is the same, wherever it now lies.
SOURCE_ROOT_KEY = "."


def check_output_dir(out: Path, source: Path | None = None) -> None:
    """OUT must be new, empty, or a previous megamoe output: never someone else's files, and never
    the ``source`` being read or a folder inside it (whatever ``.megamoe/`` folder it holds)."""
    if source is not None and source.exists():
        if out.exists() and os.path.samefile(out, source):
            raise ConvertError(f"{out}: is the source checkpoint being converted ({source}); megamoe never writes "
                               "into what it reads: choose another output directory")
        if Path(os.path.realpath(source)) in Path(os.path.realpath(out)).parents:
            raise ConvertError(f"{out}: is inside the source checkpoint being converted ({source}); megamoe never "
                               "writes into what it reads: choose an output directory outside it")
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out}: exists and is not a directory")
    if (out / STATE_DIR).is_symlink() or (out / STATE_DIR).exists() and not (out / STATE_DIR).is_dir():
        raise ConvertError(f"{out / STATE_DIR}: not a directory of its own (a link or a file); remove it by hand")
    if out.is_dir() and not (out / STATE_DIR).is_dir() and any(out.iterdir()):
        raise ConvertError(f"{out}: directory is not empty and is not a megamoe output; choose an empty directory")


def read_state_json(path: Path) -> dict[str, Any] | None:
    """A state file's JSON object, or ``None`` where it is not one (cut short, edited, binary)."""
    try:
        data = jsonio.read(path, JsonError, "state file", jsonio.MAX_STATE_BYTES)
    except JsonError:
        return None
    return data if isinstance(data, dict) else None


def recorded_source(out: Path) -> str | None:
    """The source directory an unfinished conversion into ``out`` was reading (``None``: not recorded)."""
    root = (read_state_json(out / STATE_DIR / "source.json") or {}).get(SOURCE_ROOT_KEY)
    return root if isinstance(root, str) and root else None


def differing_keys(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The keys where two plan fingerprints disagree (for errors that say what differs)."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _redundant(placement: Any) -> int | None:
    """Redundant slots of a fingerprint's placement (slots beyond the distinct logical experts)."""
    return len(placement) - len(set(placement)) if isinstance(placement, list) else None


def _ranks_text(ranks: Any, ep_size: Any) -> str:
    if isinstance(ranks, list) and isinstance(ep_size, int) and ranks == list(range(ep_size)):
        return "all"
    whole = isinstance(ranks, list) and all(isinstance(r, int) for r in ranks)
    return format_ranges(sorted(ranks)) if whole else repr(ranks)


def _layers_text(layers: Any) -> str:
    if not isinstance(layers, list):
        return repr(layers)
    return ",".join(map(str, layers)) if len(layers) <= 6 else f"{len(layers)} layers ({layers[0]} .. {layers[-1]})"


def option_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two plan fingerprints, as the options a user passes, with old and new
    values (``--num-redundant-experts 0 -> 4``); what follows from another option (the ranks and
    slots of another EP size) is not named again."""
    changed = set(differing_keys(old, new))
    out: list[str] = []
    if {"store", "ep_size"} & changed:
        ep = lambda f: "none (a store)" if f.get("store") else f.get("ep_size")  # noqa: E731
        out.append(f"--ep-size {ep(old)} -> {ep(new)}")
    if "engine" in changed and not old.get("store") and not new.get("store"):
        out.append(f"--engine {old.get('engine')} -> {new.get('engine')}")
    if "placement" in changed:
        before, after = _redundant(old.get("placement")), _redundant(new.get("placement"))
        if before != after:
            out.append(f"--num-redundant-experts {before} -> {after}")
        elif not {"store", "ep_size"} & changed:
            out.append("--placement: another expert placement")
    ranks = [_ranks_text(f.get("ranks"), f.get("ep_size")) for f in (old, new)]
    if "ranks" in changed and ranks[0] != ranks[1]:
        out.append(f"--ranks {ranks[0]} -> {ranks[1]}")
    if "layers" in changed:
        out.append(f"--layers {_layers_text(old.get('layers'))} -> {_layers_text(new.get('layers'))}")
    if "experts_only" in changed:
        out.append(f"--experts-only {'on' if old.get('experts_only') else 'off'} -> "
                   f"{'on' if new.get('experts_only') else 'off'}")
    if any(key.startswith("source_") for key in changed):
        out.append("the source checkpoint (another one, or it changed)")
    if {"format_version", "layout_version"} & changed:
        out.append("written by another megamoe-convert version")
    known = {"store", "ep_size", "engine", "placement", "ranks", "layers", "experts_only", "format_version",
             "layout_version"}
    out.extend(f"{key} {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(changed - known)
               if not key.startswith("source_"))
    return out


class OutputState:
    """The hidden ``OUT/.megamoe/`` folder: a lock, the plan fingerprint, the source stamp, the journal."""

    def __init__(self, out: Path, fsync: bool = True) -> None:
        self.out = out
        self.fsync = fsync  # --no-fsync: files are not durable, so neither need their state be
        self._use(out / STATE_DIR)

    def _use(self, folder: Path) -> None:
        self.dir = folder
        self.plan_path = folder / "plan.json"
        self.source_path = folder / "source.json"
        self.journal_path = folder / JOURNAL_NAME
        self._journal = JournalWriter(self.journal_path, self.fsync)

    def locked(self) -> AbstractContextManager[None]:
        """Hold OUT for a whole-directory writer (a conversion, or a merge): no other one, and
        no part of a split conversion, may write it meanwhile."""
        return hold_whole_output(self.out, timeout=0, who="`megamoe convert`")

    def prepare(self, fingerprint: dict[str, Any], overwrite: bool, source: dict[str, Any]) -> None:
        """Refuse foreign, differently-planned or stale output (source files changed since, or no
        record of the source at all), or state a crash or a person damaged; clear it when
        ``overwrite``. ``source``: :func:`stamps.stamp_files` of the source, plus its directory under
        :data:`SOURCE_ROOT_KEY`."""
        if self.plan_path.exists():
            problem = self._plan_problem(fingerprint) or self._source_problem(source)
            if problem:
                if not overwrite:
                    raise ConvertError(f"{self.out} {problem}; pass --overwrite to convert again")
                self.clear()
        elif overwrite:
            self.clear()
        clearing.forget_ranged_pull(self.out)  # the files it pulled are rewritten whole from here on
        self.write_state(fingerprint, source)

    def write_state(self, fingerprint: dict[str, Any], source: dict[str, Any] | None) -> None:
        """The source record first, the plan last: the plan is what marks OUT as this plan's, so a
        stop between the two leaves no plan without the record its resume needs."""
        if source is not None:
            write_json_atomic(self.source_path, json.dumps(source, indent=1, sort_keys=True), fsync=self.fsync,
                              root=self.out)
        write_json_atomic(self.plan_path, json.dumps(fingerprint, indent=1, sort_keys=True), fsync=self.fsync,
                          root=self.out)

    def _plan_problem(self, fingerprint: dict[str, Any]) -> str | None:
        previous = read_state_json(self.plan_path)
        if previous is None:
            return f"has an unreadable {self.plan_path.relative_to(self.out)} (not a JSON object)"
        changed = option_changes(previous, fingerprint)
        return f"holds a conversion made with different options ({'; '.join(changed)})" if changed else None

    def _source_problem(self, source: dict[str, Any]) -> str | None:
        if not self.source_path.exists():
            return ("has no record of the source files it was converted from (a `megamoe merge` of parts that "
                    "read different copies of the source), so its files cannot be reused for this source")
        changed = self.changed_sources(source)
        if not changed:
            return None
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return f"was converted before these source files changed (or from others): {', '.join(changed[:3])}{more}"

    def changed_sources(self, source: dict[str, Any]) -> list[str]:
        """Source entries whose stamp differs from the previous run's (all of them where the record
        is unreadable, since nothing then says they are unchanged)."""
        previous = read_state_json(self.source_path)
        if previous is None:
            return sorted(set(source) - {SOURCE_ROOT_KEY})
        return [name for name, stamp in source.items() if name != SOURCE_ROOT_KEY and previous.get(name) != stamp]

    def clear(self) -> None:
        """Remove what a previous conversion (or merge) wrote, and nothing else
        (:func:`clearing.remove_results`), then this state's journal and source stamp."""
        journal = self.journal()  # read first: an unreadable journal fails the run before anything goes
        clearing.remove_results(self.out, journal)
        self.journal_path.unlink(missing_ok=True)
        self.source_path.unlink(missing_ok=True)

    def journal(self, path: Path | None = None) -> dict[str, FileRecord]:
        """The committed files of the journal at ``path`` (default: this run's)."""
        return read_journal(path or self.journal_path)

    def record(self, rec: FileRecord) -> None:
        self._journal.append(rec)

    def remove_partials(self) -> None:
        """The tool's own temporary files (``.NAME.partial``) at the top and in rank folders."""
        clearing.remove_partials(self.out)


class PartState(OutputState):
    """State of one part of a split conversion, in ``OUT/.megamoe/part-I-of-N/``.

    Parts may run at the same time into one shared OUT: each has its own lock, plan and
    journal, and touches only its own files (no directory-wide cleanup).
    """

    def __init__(self, out: Path, shard: dict[str, Any], paths: list[str], fsync: bool = True) -> None:
        super().__init__(out, fsync)
        index, count = shard["index"], shard["count"]
        self.root_plan_path, self.root_journal_path = self.plan_path, self.journal_path
        self.root_source_path = self.source_path
        self.shard = shard
        self._use(out / STATE_DIR / part_name(index, count))
        self.part_manifest = out / part_manifest_name(index, count)
        self.merged_part_manifest = out / MERGED_PARTS_DIR / part_manifest_name(index, count)
        self.paths = paths

    def locked(self) -> AbstractContextManager[None]:
        """Hold this part's lock; refuse if another run holds it, or a whole-directory writer OUT."""
        return hold_part(self.out, self.dir, f"{self.shard['index']}/{self.shard['count']}")

    def prepare(self, fingerprint: dict[str, Any], overwrite: bool, source: dict[str, Any]) -> None:
        # A whole conversion already in OUT (single-machine or merged) must be of the same plan.
        if self.root_plan_path.exists() and read_state_json(self.root_plan_path) != fingerprint:
            if not overwrite:
                raise ConvertError(f"{self.out} holds a conversion made with different options; "
                                   "pass --overwrite (to every part) to replace it")
            if self.root_journal_path.exists():  # kept for merge, to delete what the new plan does not write
                faults.before_rename(self.root_journal_path.with_name(REPLACED_JOURNAL))
                os.replace(self.root_journal_path, self.root_journal_path.with_name(REPLACED_JOURNAL))
            self.root_source_path.unlink(missing_ok=True)
            self.root_plan_path.unlink(missing_ok=True)  # last: until it goes, a rerun finds what to replace
        super().prepare(fingerprint | {"shard": self.shard}, overwrite, source)
        self.part_manifest.unlink(missing_ok=True)  # this part is not finished until it is rewritten
        self.merged_part_manifest.unlink(missing_ok=True)

    def clear(self) -> None:
        clearing.remove_owned(self.out, self.journal().values())
        self.journal_path.unlink(missing_ok=True)
        self.part_manifest.unlink(missing_ok=True)
        self.merged_part_manifest.unlink(missing_ok=True)

    def remove_partials(self) -> None:
        clearing.remove_partials(self.out, self.paths)  # only this part's: others may be writing theirs now
