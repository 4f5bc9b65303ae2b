"""Hugging Face hub: sources by repo id and ``megamoe pull`` of single ranks (``megamoe push``:
:mod:`.hub_push`, built on the repo ids, error messages and file checks here).

Thin on purpose: downloads go through ``huggingface_hub.snapshot_download`` (so the HF cache,
``HF_HUB_CACHE``/``HF_HOME``, ``HF_HUB_OFFLINE``, tokens and revisions behave as everywhere
else). What this module adds is megamoe's own contract:

* ``pull`` reads the manifest first, pins its commit, then downloads only the manifest,
  the small files, the non-expert shards and the named ranks' shards (allow-patterns from
  the manifest), and checks every downloaded file's size and checksum.
* :func:`resolve_converted` turns a repo id into a local converted directory holding just
  the ranks asked for (used by ``load_rank``; a local directory is returned unchanged).

The hub's ``README.md`` is the generated model card, not a file of the conversion: if the
source checkpoint had a README, its text (and front matter: licence...) is kept in the
card, and ``pull`` neither downloads nor checks ``README.md``.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import huggingface_hub
import huggingface_hub.constants
import huggingface_hub.errors
import huggingface_hub.file_download
import huggingface_hub.utils

from megamoe_convert.errors import HubError, ManifestError, PlacementError
from megamoe_convert.hub.card import CARD_NAME
from megamoe_convert.layout.placement import parse_ranks
from megamoe_convert.output import ranged
from megamoe_convert.output.clearing import remove_owned
from megamoe_convert.output.locks import hold_whole_output
from megamoe_convert.output.manifest import Manifest, read_manifest
from megamoe_convert.output.naming import MANIFEST_NAME, STORE_DIR, owned_path, rank_dir_name
from megamoe_convert.output.preflight import check_no_links
from megamoe_convert.output.resume import check_output_dir
from megamoe_convert.output.writer import FileRecord, check_writable_name, file_problem, make_dirs_inside, partial_path
from megamoe_convert.source.checkpoint import INDEX_NAME

REPO_TYPE = "model"
#: ``owner/name`` or ``owner/name@revision`` (the hub's own rules are checked by huggingface_hub).
_REPO_REF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[^\s@]+))?$")


# --------------------------------------------------------------------------------------
# Repo ids and library calls
# --------------------------------------------------------------------------------------

def parse_repo_ref(text: str) -> tuple[str, str | None] | None:
    """``"owner/name"`` -> ``("owner/name", None)``, ``"owner/name@rev"`` -> ``(..., "rev")``;
    ``None`` when ``text`` cannot be a hub model id (a path: absolute, ``./x``, ``a/b/c``...)."""
    m = _REPO_REF.match(str(text))
    if m is None or m["repo"].endswith((".", "-")) or ".." in m["repo"]:
        return None
    try:
        huggingface_hub.utils.validate_repo_id(m["repo"])
    except ValueError:
        return None
    return m["repo"], m["revision"]


def _describe(repo_id: str, revision: str | None, e: BaseException) -> str:
    errors = huggingface_hub.errors
    where = f"{repo_id}@{revision}" if revision else repo_id
    if isinstance(e, errors.RevisionNotFoundError):
        return f"{where}: revision {revision!r} not found on the Hugging Face hub"
    if isinstance(e, errors.RepositoryNotFoundError):
        return (f"{repo_id}: repository not found on the Hugging Face hub (if it is private or gated, log in with "
                "`hf auth login` or set HF_TOKEN)")
    if isinstance(e, errors.LocalEntryNotFoundError):
        cache = huggingface_hub.constants.HF_HUB_CACHE
        if huggingface_hub.constants.HF_HUB_OFFLINE:
            return f"{where}: not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set"
        return f"{where}: the Hugging Face hub cannot be reached and the files are not in the cache ({cache})"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, errors.OfflineModeIsEnabled):
        return f"{where}: the Hugging Face hub is not reachable while HF_HUB_OFFLINE is set (unset it to reach the hub)"
    if isinstance(e, _network_errors()):
        return (f"{where}: cannot reach the Hugging Face hub at {huggingface_hub.constants.ENDPOINT} ({first}): check "
                "the network, a proxy or HF_ENDPOINT, then rerun")
    return f"{where}: {first}"


def _network_errors() -> tuple[type[BaseException], ...]:
    """The HTTP clients' own errors (no network, DNS, TLS, timeouts), for whichever is installed."""
    found = []
    for module, name in (("httpx2", "HTTPError"), ("httpx", "HTTPError"), ("requests", "RequestException")):
        try:
            found.append(getattr(__import__(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)


def _hub_errors() -> tuple[type[BaseException], ...]:
    errors = huggingface_hub.errors
    return (errors.HfHubHTTPError, errors.EntryNotFoundError, errors.OfflineModeIsEnabled, errors.HFValidationError,
            OSError, *_network_errors())


def _snapshot(repo_id: str, revision: str | None, note: str = "", **kwargs: Any) -> Path:
    """The repo's files through the HF cache; a hub problem is a :class:`HubError` ending with ``note``."""
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, repo_type=REPO_TYPE, revision=revision, **kwargs))
    except _hub_errors() as e:
        raise HubError(_describe(repo_id, revision, e) + note) from None


# --------------------------------------------------------------------------------------
# Sources (``megamoe convert REPO_ID OUT``)
# --------------------------------------------------------------------------------------

def resolve_source(src: str, revision: str | None = None) -> Path:
    """A checkpoint directory: ``src`` itself if it exists, else the hub repo ``src`` (or
    ``src@revision``) downloaded into the HF cache (honouring ``HF_HUB_OFFLINE``, the cache
    location and tokens); returns the snapshot directory."""
    path = Path(src)
    if path.exists():
        return path
    ref = parse_repo_ref(src)
    if ref is None:
        raise HubError(f"{src}: no such directory (and not a Hugging Face repo id like owner/name)")
    repo_id, rev = ref
    return _snapshot(repo_id, revision or rev)


# --------------------------------------------------------------------------------------
# Pull
# --------------------------------------------------------------------------------------

@dataclass
class PullResult:
    path: Path  # the converted directory (``local_dir``, or the snapshot in the HF cache)
    repo_id: str
    commit: str
    ranks: list[int]
    files: list[FileRecord] = field(default_factory=list)
    verified: str = "checksum"
    not_downloaded: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "repo_id": self.repo_id, "commit": self.commit, "ranks": self.ranks,
                "files": len(self.files), "bytes": sum(f.size for f in self.files), "verified": self.verified,
                "not_downloaded": self.not_downloaded}


def _parse_pull_ranks(ranks: str | Iterable[int] | None, manifest: Manifest, where: str) -> list[int]:
    if ranks is None or manifest.store:  # a store's ranks are the engine's: whole (or `pull --ep-size`)
        return list(manifest.ranks)
    chosen = parse_ranks(ranks, manifest.ep_size, where) if isinstance(ranks, str) else sorted(set(ranks))
    for rank in chosen:
        manifest.placement.check_rank(rank)
    missing = [r for r in chosen if r not in manifest.ranks]
    if missing:
        raise HubError(f"{where}: rank {missing[0]} was not converted (this conversion has ranks {manifest.ranks} "
                       f"of ep_size={manifest.ep_size})")
    return chosen


def select_files(manifest: Manifest, ranks: Sequence[int], non_expert: bool = True,
                 experts: bool = True) -> tuple[list[FileRecord], list[str]]:
    """The manifest's files a pull of ``ranks`` needs, and the allow-patterns that fetch them.

    Always the small files (config, tokenizer...); the non-expert shards if ``non_expert``;
    every layer's shard of each rank (a store: its whole ``experts/``; ``experts=False``: no
    expert file, as :mod:`.hub_ranges` fetches just ranges of them). Never ``README.md``.
    """
    rank_dirs = {STORE_DIR} if manifest.store else {rank_dir_name(r, manifest.ep_size) for r in ranks}
    rank_dirs = rank_dirs if experts else set()
    chosen = []
    for record in manifest.files:
        top, _, rest = record.path.partition("/")
        if rest:  # in a rank directory
            if top in rank_dirs:
                chosen.append(record)
        elif record.path == CARD_NAME:
            continue
        elif non_expert or not (record.path.endswith(".safetensors") or record.path == INDEX_NAME):
            chosen.append(record)
    patterns = [glob.escape(MANIFEST_NAME)] + [f"{glob.escape(d)}/*" for d in sorted(rank_dirs)]
    patterns += [glob.escape(r.path) for r in chosen if "/" not in r.path]
    return chosen, list(dict.fromkeys(patterns))


def verify_files(root: Path, records: Sequence[FileRecord], checksums: bool, where: str, workers: int = 8,
                 missing: str = "missing", refusing: str = "") -> None:
    """Every record present under ``root`` with its size (and checksum): else :class:`HubError`
    (its message led by ``refusing``, what the caller will not do)."""

    def check(record: FileRecord) -> None:
        path = root / record.path
        problem = file_problem(path, record, where, checksum=checksums)
        if problem and problem.startswith("missing"):
            problem = problem.replace("missing", missing, 1)
        elif problem and problem.startswith("checksum"):
            problem += "; corrupted download or cache: rerun with --force-download"
        if problem:
            raise HubError(f"{refusing}{path}: {problem}")

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(check, records))


@dataclass
class Pinned:
    """Step 1 of every pull: one commit's manifest, read from the HF cache (nothing local changed yet)."""

    repo_id: str
    commit: str
    manifest: Manifest
    snapshot: Path  # the cache snapshot that holds the manifest
    where: str


def pin(repo_id: str, revision: str | None = None, force_download: bool = False, note: str = "") -> Pinned:
    """The manifest alone, through the cache: its snapshot directory is named by the commit, which
    then pins every other file (and every range) of the pull to that commit (``note`` ends the
    error when the hub does not give it)."""
    ref = parse_repo_ref(repo_id)
    if ref is None:
        raise HubError(f"{repo_id}: not a Hugging Face repo id (expected owner/name)")
    repo_id, rev = ref
    revision = revision or rev
    first = _snapshot(repo_id, revision, note, allow_patterns=[MANIFEST_NAME], force_download=force_download)
    where = f"{repo_id}@{revision or 'main'}"
    if not (first / MANIFEST_NAME).exists():
        raise HubError(f"{where}: no {MANIFEST_NAME}: not a megamoe conversion, or its `megamoe push` did not finish")
    manifest = read_manifest(first)
    is_commit = huggingface_hub.file_download.REGEX_COMMIT_HASH.fullmatch(first.name)
    commit = first.name if is_commit else (revision or "main")
    return Pinned(repo_id, commit, manifest, first, where)


def pull(repo_id: str, ranks: str | Iterable[int] | None = None, local_dir: Path | str | None = None,
         revision: str | None = None, *, non_expert: bool = True, verify: bool = True,
         force_download: bool = False, max_workers: int = 8, experts: bool = True, note: str = "") -> PullResult:
    """Download a pushed conversion's manifest, small files, non-expert shards (unless
    ``non_expert=False``) and the shards of ``ranks`` (``"0-7"``, a list, or ``None`` for all);
    then check sizes and (``verify``) checksums of everything downloaded.

    ``local_dir=None`` downloads into the HF cache and returns the snapshot directory. Into
    ``local_dir``, the pull is one transaction bound to the commit (:func:`pull_into`). ``note``
    ends the error when the hub cannot give the repo at all (:func:`pin`).
    """
    pinned = pin(repo_id, revision, force_download, note)
    chosen_ranks = _parse_pull_ranks(ranks, pinned.manifest, pinned.where)
    records, patterns = select_files(pinned.manifest, chosen_ranks, non_expert, experts)
    if local_dir is None:
        path = _download_checked(pinned, records, patterns, None, non_expert, verify=verify,
                                 force_download=force_download, max_workers=max_workers)
    else:
        local = Path(local_dir)
        with claim_local_dir(local, "`megamoe pull`"):
            had_record = ranged.read_record(local, HubError, damaged_ok=True) is not None \
                or os.path.lexists(ranged.record_path(local))
            ranged.write_record(local, ranged.RangedRecord(pinned.commit))  # nothing served until it is done
            path = pull_into(pinned, local, records, patterns, non_expert, verify=verify, drop_store=had_record,
                             force_download=force_download, max_workers=max_workers)
            ranged.record_path(local).unlink()  # every listed file whole and checked: a complete folder
    skipped = [CARD_NAME] if any(r.path == CARD_NAME for r in pinned.manifest.files) else []
    return PullResult(path, pinned.repo_id, pinned.commit, chosen_ranks, records, "checksum" if verify else "size",
                      skipped)


@contextmanager
def claim_local_dir(local_dir: Path, who: str) -> Iterator[None]:
    """``pull --local-dir`` writes like every whole-directory writer: only into a new, empty or earlier
    megamoe folder (never a foreign one, a checkpoint say), and under its lock."""
    check_output_dir(local_dir)
    with hold_whole_output(local_dir, timeout=0, who=who):
        yield


def pull_into(pinned: Pinned, local: Path, records: list[FileRecord], patterns: list[str], non_expert: bool, *,
              verify: bool, drop_store: bool, force_download: bool = False, max_workers: int = 8) -> Path:
    """Steps 2 and 3 of a pull into ``local`` (its lock held, its record marking it unfinished): the
    files of the conversion it held before that this commit lists otherwise go first (``drop_store``:
    the store files too, sparse ones of a ranged pull), then the commit's files come down and are
    checked, then its manifest, last."""
    _remove_older(local, pinned.manifest, drop_store)
    own = [p for p in patterns if p != glob.escape(MANIFEST_NAME)]  # the manifest comes last, from the cache
    path = _download_checked(pinned, records, own, local, non_expert, verify=verify, force_download=force_download,
                             max_workers=max_workers)
    link_into(pinned.snapshot, local, [MANIFEST_NAME])
    return path


def _remove_older(local: Path, manifest: Manifest, drop_store: bool) -> None:
    """The older conversion's files that ``manifest`` does not list with the same bytes, and (``drop_store``)
    its store files: removed the way clearing removes (only the tool's own, still as recorded), so none
    is ever served under the new manifest; then the older manifest itself."""
    try:
        older = read_manifest(local).files if (local / MANIFEST_NAME).is_file() else []
    except (ManifestError, PlacementError):  # no finished conversion's record: nothing of it to remove
        older = []
    new = {r.path: r for r in manifest.files}
    stale = [r for r in older if new.get(r.path) != r]
    if drop_store:
        stale += [r for r in (older or manifest.files) if r.path.startswith(f"{STORE_DIR}/") and r not in stale]
    remove_owned(local, stale)
    (local / MANIFEST_NAME).unlink(missing_ok=True)


def _download_checked(pinned: Pinned, records: list[FileRecord], patterns: list[str], local_dir: Path | None,
                      non_expert: bool, *, verify: bool, force_download: bool, max_workers: int) -> Path:
    """Download at the pinned commit, then check against its manifest."""
    repo_id, commit, manifest = pinned.repo_id, pinned.commit, pinned.manifest
    from_cache = local_dir is not None and huggingface_hub.constants.HF_HUB_OFFLINE
    if local_dir is not None:  # huggingface_hub writes into local_dir itself: no link on the way, first
        check_no_links(local_dir, (r.path for r in records))
    path = _snapshot(repo_id, commit, allow_patterns=patterns, local_dir=None if from_cache else local_dir,
                     force_download=force_download, max_workers=max_workers)
    if local_dir is None or from_cache:  # the cache's manifest came down again: still the pinned one?
        if read_manifest(path).to_json() != manifest.to_json():
            raise HubError(f"{path / MANIFEST_NAME}: differs from {pinned.where}'s (the repo changed during the "
                           "pull); rerun")
    missing = ("not in the Hugging Face cache, and HF_HUB_OFFLINE is set" if huggingface_hub.constants.HF_HUB_OFFLINE
               else "missing after the download (an incomplete push?)")
    verify_files(path, records, verify, f"{MANIFEST_NAME} of {repo_id}@{commit[:12]}", max_workers, missing)
    if from_cache and local_dir is not None:
        index = [INDEX_NAME] if non_expert and (path / INDEX_NAME).is_file() else []
        path = link_into(path, local_dir, [*index, *(r.path for r in records)])
    return path


def link_into(snapshot: Path, local_dir: Path, paths: Sequence[str]) -> Path:
    """Put ``paths`` of a cache snapshot into ``local_dir``: hard links to the cache's blobs
    where the filesystem allows, copies otherwise; each appears by rename, the manifest last."""
    for rel in sorted(paths, key=lambda rel: rel == MANIFEST_NAME):
        src, dst = (snapshot / rel).resolve(), owned_path(local_dir, rel)  # the blob, not the snapshot's symlink
        if dst is None:
            raise HubError(f"{local_dir / rel}: not a path inside {local_dir} that megamoe writes")
        make_dirs_inside(local_dir, dst.parent)
        check_writable_name(dst)
        tmp = partial_path(dst)
        check_writable_name(tmp)
        tmp.unlink(missing_ok=True)
        try:
            try:
                os.link(src, tmp)
            except OSError:
                shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
        except OSError as e:  # a full disk, say: no temporary file is left, and the error names the file
            tmp.unlink(missing_ok=True)
            raise OSError(e.errno, e.strerror, str(dst)) from None
    return local_dir


def resolve_converted(out_or_repo: Path | str, ranks: Iterable[int] | None = None, *, revision: str | None = None,
                      verify: bool = False, non_expert: bool = False) -> Path:
    """A converted directory for loading ``ranks``: a local path is returned as it is; a hub
    repo id (``owner/name`` or ``owner/name@revision``) is pulled into the HF cache, just the
    manifest, the small files and those ranks' shards (``non_expert=True`` adds the non-expert
    shards), sizes checked (``verify``: checksums too), and the snapshot directory returned.

    A repo the hub cannot give is a :class:`~megamoe_convert.errors.HubError` that also says the
    name is no local directory; any later problem raises its own class.
    """
    path = Path(out_or_repo)
    if path.exists() or parse_repo_ref(str(out_or_repo)) is None:
        return path
    return pull(str(out_or_repo), None if ranks is None else list(ranks), None, revision,
                non_expert=non_expert, verify=verify, note=f" ({out_or_repo} is not a local directory either)").path
