"""Hugging Face hub: sources by repo id, ``megamoe push`` and ``megamoe pull`` of single ranks.

Thin on purpose: downloads go through ``huggingface_hub.snapshot_download`` (so the HF cache,
``HF_HUB_CACHE``/``HF_HOME``, ``HF_HUB_OFFLINE``, tokens and revisions behave as everywhere
else), uploads through ``HfApi``. What this module adds is megamoe's own contract:

* ``push`` uploads only what ``manifest.json`` lists (plus the non-expert index), then the
  manifest and a generated model card in one last commit: on the hub as on disk, a
  ``manifest.json`` means every file it lists is there. A different manifest already in
  the repo is deleted first.
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
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence
from megamoe_convert.errors import HubError  # noqa: F401

import huggingface_hub
import huggingface_hub.constants
import huggingface_hub.errors
import huggingface_hub.file_download
import huggingface_hub.utils

from megamoe_convert import __version__, jsonio
from megamoe_convert.errors import ManifestError
from megamoe_convert.output.manifest import Manifest, read_manifest
from megamoe_convert.output.naming import MANIFEST_NAME, STORE_DIR, rank_dir_name
from megamoe_convert.output.preflight import check_no_links
from megamoe_convert.errors import ConvertError
from megamoe_convert.output.locks import hold_whole_output
from megamoe_convert.output.naming import owned_path
from megamoe_convert.output.writer import FileRecord, check_writable_name, file_problem, make_dirs_inside, partial_path
from megamoe_convert.placement import PlacementError, parse_ranks
from megamoe_convert.source import families
from megamoe_convert.source.checkpoint import INDEX_NAME

CARD_NAME = "README.md"
REPO_TYPE = "model"
CARD_TAGS = ["megamoe", "deepgemm", "mixture-of-experts", "deepseek-v4"]
#: ``owner/name`` or ``owner/name@revision`` (the hub's own rules are checked by huggingface_hub).
_REPO_REF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[^\s@]+))?$")
_CACHE_SNAPSHOT = re.compile(r"models--(?P<owner>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})$")


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


def _snapshot(repo_id: str, revision: str | None, **kwargs: Any) -> Path:
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, repo_type=REPO_TYPE, revision=revision, **kwargs))
    except _hub_errors() as e:
        raise HubError(_describe(repo_id, revision, e)) from None


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
    try:
        chosen = parse_ranks(ranks, manifest.ep_size) if isinstance(ranks, str) else sorted(set(ranks))
        for rank in chosen:
            manifest.placement.check_rank(rank)
    except PlacementError as e:
        raise HubError(f"{where}: {e}") from None
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
    if non_expert and not manifest.experts_only:
        patterns.append(glob.escape(INDEX_NAME))  # older manifests do not list it
    return chosen, list(dict.fromkeys(patterns))


def verify_files(root: Path, records: Sequence[FileRecord], checksums: bool, where: str, workers: int = 8,
                 missing: str = "missing") -> None:
    """Every record present under ``root`` with its size (and checksum): else :class:`HubError`."""

    def check(record: FileRecord) -> None:
        path = root / record.path
        problem = file_problem(path, record, where, checksum=checksums)
        if problem and problem.startswith("missing"):
            problem = problem.replace("missing", missing, 1)
        elif problem and problem.startswith("checksum"):
            problem += "; corrupted download or cache: rerun with --force-download"
        if problem:
            raise HubError(f"{path}: {problem}")

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(check, records))


def pull(repo_id: str, ranks: str | Iterable[int] | None = None, local_dir: Path | str | None = None,
         revision: str | None = None, *, non_expert: bool = True, verify: bool = True,
         force_download: bool = False, max_workers: int = 8, experts: bool = True) -> PullResult:
    """Download a pushed conversion's manifest, small files, non-expert shards (unless
    ``non_expert=False``) and the shards of ``ranks`` (``"0-7"``, a list, or ``None`` for all);
    then check sizes and (``verify``) checksums of everything downloaded.

    ``local_dir=None`` downloads into the HF cache and returns the snapshot directory.
    """
    ref = parse_repo_ref(repo_id)
    if ref is None:
        raise HubError(f"{repo_id}: not a Hugging Face repo id (expected owner/name)")
    repo_id, rev = ref
    revision = revision or rev
    # 1. The manifest alone, through the cache: its snapshot directory is named by the commit,
    #    which then pins every other file to the same commit.
    first = _snapshot(repo_id, revision, allow_patterns=[MANIFEST_NAME], force_download=force_download)
    where = f"{repo_id}@{revision or 'main'}"
    try:
        manifest = read_manifest(first)
    except ManifestError as e:
        if not (first / MANIFEST_NAME).exists():
            raise HubError(f"{where}: no {MANIFEST_NAME}: not a megamoe conversion, or its `megamoe push` did not "
                           "finish") from None
        raise HubError(f"{where}: {e}") from None
    commit = first.name if huggingface_hub.file_download.REGEX_COMMIT_HASH.fullmatch(first.name) else (revision or "main")
    chosen_ranks = _parse_pull_ranks(ranks, manifest, where)
    records, patterns = select_files(manifest, chosen_ranks, non_expert, experts)
    # 2. Everything else, at that commit. Offline, huggingface_hub looks only inside local_dir,
    #    so the files are taken from the cache and linked into local_dir after the checks.
    with nullcontext() if local_dir is None else _holding(Path(local_dir)):
        path = _download_checked(repo_id, commit, where, manifest, records, patterns, local_dir, non_expert,
                                 verify=verify, force_download=force_download, max_workers=max_workers)
    skipped = [CARD_NAME] if any(r.path == CARD_NAME for r in manifest.files) else []
    return PullResult(path, repo_id, commit, chosen_ranks, records, "checksum" if verify else "size", skipped)


@contextmanager
def _holding(local_dir: Path) -> Iterator[None]:
    """``pull --local-dir`` writes like any other whole-directory writer: under OUT's lock."""
    try:
        with hold_whole_output(local_dir, timeout=0, who="`megamoe pull`"):
            yield
    except ConvertError as e:
        raise HubError(str(e)) from None


def _download_checked(repo_id: str, commit: str, where: str, manifest: Manifest, records: list[FileRecord],
                      patterns: list[str], local_dir: Path | str | None, non_expert: bool, *, verify: bool,
                      force_download: bool, max_workers: int) -> Path:
    """Steps 2 and 3 of :func:`pull`: download at ``commit``, then check against ``manifest``."""
    from_cache = local_dir is not None and huggingface_hub.constants.HF_HUB_OFFLINE
    if local_dir is not None:  # huggingface_hub writes into local_dir itself: no link on the way, first
        try:
            check_no_links(Path(local_dir), sorted({(Path(local_dir) / r.path).parent for r in records}))
        except OSError as e:
            raise HubError(f"{e.filename}: {e.strerror}") from None
    path = _snapshot(repo_id, commit, allow_patterns=patterns, local_dir=None if from_cache else local_dir,
                     force_download=force_download, max_workers=max_workers)
    # 3. Check what came down against the manifest (of the same commit).
    try:
        if read_manifest(path).to_json() != manifest.to_json():
            raise HubError(f"{path / MANIFEST_NAME}: differs from {where}'s (the repo changed during the pull); rerun")
    except ManifestError as e:
        raise HubError(str(e)) from None
    missing = ("not in the Hugging Face cache, and HF_HUB_OFFLINE is set" if huggingface_hub.constants.HF_HUB_OFFLINE
               else "missing after the download (an incomplete push?)")
    verify_files(path, records, verify, f"{MANIFEST_NAME} of {repo_id}@{commit[:12]}", max_workers, missing)
    if from_cache:
        index = [INDEX_NAME] if non_expert and (path / INDEX_NAME).is_file() else []
        path = link_into(path, Path(local_dir), [MANIFEST_NAME, *index, *(r.path for r in records)])
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
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    return local_dir


def resolve_converted(out_or_repo: Path | str, ranks: Iterable[int] | None = None, *, revision: str | None = None,
                      verify: bool = False, non_expert: bool = False) -> Path:
    """A converted directory for loading ``ranks``: a local path is returned as it is; a hub
    repo id (``owner/name`` or ``owner/name@revision``) is pulled into the HF cache, just the
    manifest, the small files and those ranks' shards (``non_expert=True`` adds the non-expert
    shards), sizes checked (``verify``: checksums too), and the snapshot directory returned.

    Raises :class:`megamoe_convert.serve.errors.LoadError` on any hub problem.
    """
    path = Path(out_or_repo)
    if path.exists() or parse_repo_ref(str(out_or_repo)) is None:
        return path
    from megamoe_convert.serve.errors import LoadError
    try:
        return pull(str(out_or_repo), None if ranks is None else list(ranks), None, revision,
                    non_expert=non_expert, verify=verify).path
    except HubError as e:
        raise LoadError(f"{e} ({out_or_repo} is not a local directory either)") from None


# --------------------------------------------------------------------------------------
# Push
# --------------------------------------------------------------------------------------

def _source_label(source: dict[str, Any]) -> tuple[str, str | None]:
    """A source path in the HF cache -> ``("owner/name@commit", "owner/name")``; else the path."""
    path = str(source.get("path", ""))
    m = _CACHE_SNAPSHOT.search(path)
    if m is None:
        return path, None
    repo = f"{m['owner']}/{m['name']}"
    return f"{repo}@{m['commit'][:12]}", repo


def _ranges(values: Sequence[int]) -> str:
    from megamoe_convert.source.checkpoint import _ranges as ranges
    return ranges(list(values))


def model_card(out: Path, manifest: Manifest, repo_id: str, revision: str | None = None) -> str:
    """The hub's README.md: what this conversion is, for whom, and how to use it (the usage
    lines name the branch pushed to and ranks this conversion holds, so they work as written)."""
    placement = manifest.placement
    label, base_model = _source_label(manifest.source)
    metadata: dict[str, Any] = {}
    original = ""
    source_card = out / CARD_NAME
    if source_card.is_file() and any(r.path == CARD_NAME for r in manifest.files):
        card = huggingface_hub.ModelCard.load(source_card, ignore_metadata_errors=True)
        metadata = card.data.to_dict()
        original = card.text.strip()
    metadata["tags"] = list(dict.fromkeys([*(metadata.get("tags") or []), *CARD_TAGS]))
    if base_model:
        metadata["base_model"] = base_model
    data = huggingface_hub.ModelCardData(**metadata)
    decoder = sum(1 for layer in manifest.layers if not layer.is_mtp)
    mtp = len(manifest.layers) - decoder
    by_rank: dict[str, int] = {}
    for record in manifest.files:
        top, _, rest = record.path.partition("/")
        if rest:
            by_rank[top] = by_rank.get(top, 0) + record.size
    per_rank = max(by_rank.values(), default=0)
    ranks = "all" if manifest.ranks == list(range(manifest.ep_size)) else _ranges(manifest.ranks)
    kind = ("vLLM default: physical slot p holds logical expert p % n_routed" if placement.is_default()
            else "custom (EPLB or --placement file)")
    lines = [
        f"# {repo_id}",
        "",
        f"{families.by_name(manifest.family).title} routed experts pre-laid-out for DeepGEMM's **MegaMoE** kernel, "
        f"expert-parallel size "
        f"**{manifest.ep_size}**: one file per (rank, MoE layer), so that every vLLM rank loads its experts with "
        f"no transform. Made by megamoe-convert {__version__}.",
        "",
        "| | |",
        "|---|---|",
        f"| source | `{label}` |",
        f"| ep_size | {manifest.ep_size} (ranks: {ranks}) |",
        f"| MoE layers | {decoder} decoder + {mtp} MTP |",
        f"| experts | {placement.n_logical} logical + {placement.num_redundant} redundant = "
        f"{placement.n_physical} slots, {placement.experts_per_rank} per rank |",
        f"| placement | {kind} |",
        f"| layout version | {manifest.layout_version} (DeepGEMM `transform_weights_for_mega_moe`) |",
        f"| format version | {manifest.format_version} |",
        f"| non-expert weights | {'not included (--experts-only)' if manifest.experts_only else 'included'} |",
        f"| size | {sum(r.size for r in manifest.files) / 1e9:.2f} GB in {len(manifest.files)} files; "
        f"{per_rank / 1e9:.2f} GB of experts per rank |",
        "",
        "## Placement",
        "",
        "| rank | physical slots | logical experts |",
        "|---|---|---|",
    ]
    shown = manifest.ranks if len(manifest.ranks) <= 16 else manifest.ranks[:8]
    for rank in shown:
        start = placement.experts_start(rank)
        ids = ", ".join(map(str, placement.rank_logical_ids(rank)))
        ids = ids if len(ids) <= 120 else ids[:116] + " ..."
        lines.append(f"| {rank} | {start}..{start + placement.experts_per_rank - 1} | {ids} |")
    if len(shown) < len(manifest.ranks):
        lines.append(f"| ... | | ({len(manifest.ranks) - len(shown)} more ranks: see manifest.json) |")
    revision_flag = f" --revision {revision}" if revision else ""
    repo_ref = f"{repo_id}@{revision}" if revision else repo_id
    first_rank = manifest.ranks[0]
    lines += [
        "",
        "## Use",
        "",
        "```bash",
        "pip install /path/to/megamoe-convert   # a checkout of megamoe-convert (not on PyPI)",
        f"megamoe pull {repo_id}{revision_flag} --ranks {_ranges(manifest.ranks)} --local-dir ./model"
        "   # only what these ranks need",
        "```",
        "",
        "```python",
        "from megamoe_convert.loader import load_rank",
        f'experts = load_rank("{repo_ref}", rank={first_rank}, device="cuda:0")'
        f"  # pulls just rank {first_rank} into the HF cache",
        "```",
        "",
        f"`{MANIFEST_NAME}` lists every file with its size and xxh3-128 checksum; `megamoe pull` checks them.",
    ]
    if original:
        lines += ["", "## Original model card", "", original]
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n"


def upload_patterns(manifest: Manifest, out: Path) -> list[str]:
    """Allow-patterns for the data upload: the manifest's files (not the card) and the index."""
    dirs = sorted({r.path.partition("/")[0] for r in manifest.files if "/" in r.path})
    patterns = [f"{glob.escape(d)}/*" for d in dirs]
    patterns += [glob.escape(r.path) for r in manifest.files if "/" not in r.path and r.path != CARD_NAME]
    if (out / INDEX_NAME).is_file():
        patterns.append(glob.escape(INDEX_NAME))
    return patterns


def push(out: Path | str, repo_id: str, *, revision: str | None = None, private: bool = False,
         verify: bool = False, commit_message: str | None = None, token: str | None = None) -> dict[str, Any]:
    """Upload a finished conversion to a hub model repo (created if needed; ``revision``: a
    branch, created from main if needed). Resumable: rerun the same push after a failure.

    The data goes first (a resumable multi-commit folder upload); ``manifest.json`` and the
    model card go last, in one commit.
    """
    out = Path(out)
    manifest = read_manifest(out)  # only finished conversions are pushed
    if parse_repo_ref(repo_id) is None or "@" in repo_id:
        raise HubError(f"{repo_id}: not a Hugging Face repo id (expected owner/name; use --revision for a branch)")
    where = f"{repo_id}@{revision or 'main'}"
    try:
        verify_files(out, manifest.files, verify, str(out / MANIFEST_NAME))
    except HubError as e:
        raise HubError(f"not pushing {out}: {e}") from None
    card = model_card(out, manifest, repo_id, revision)
    local_manifest = jsonio.read_regular(out / MANIFEST_NAME, HubError, "manifest", jsonio.MAX_MANIFEST_BYTES)
    message = commit_message or f"megamoe-convert {__version__}: EP {manifest.ep_size} MegaMoE shards"
    api = huggingface_hub.HfApi(token=token)
    try:
        url = api.create_repo(repo_id, repo_type=REPO_TYPE, private=private, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, repo_type=REPO_TYPE, exist_ok=True)
        _remove_stale_manifest(api, repo_id, revision, local_manifest)
        patterns = upload_patterns(manifest, out)
        upload_large = getattr(api, "upload_large_folder", None)  # huggingface_hub < 2
        if upload_large is not None:
            upload_large(repo_id=repo_id, folder_path=out, repo_type=REPO_TYPE, revision=revision,
                         private=private, allow_patterns=patterns, ignore_patterns=[".*", "**/.*"])
        else:  # >= 2: upload_folder streams, batches commits and resumes by itself
            api.upload_folder(repo_id=repo_id, folder_path=out, repo_type=REPO_TYPE, revision=revision,
                              allow_patterns=patterns, ignore_patterns=[".*", "**/.*"], commit_message=message)
        ops = [huggingface_hub.CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=card.encode()),
               huggingface_hub.CommitOperationAdd(path_in_repo=MANIFEST_NAME, path_or_fileobj=local_manifest)]
        info = api.create_commit(repo_id, ops, commit_message=f"{message}: manifest and model card",
                                 repo_type=REPO_TYPE, revision=revision)
    except _hub_errors() as e:
        raise HubError(_describe(repo_id, revision, e)) from None
    return {"repo_id": repo_id, "revision": revision or "main", "commit": getattr(info, "oid", None),
            "url": str(url), "files": len(manifest.files), "bytes": sum(r.size for r in manifest.files),
            "ep_size": manifest.ep_size, "ranks": manifest.ranks, "where": where}


def _remove_stale_manifest(api: Any, repo_id: str, revision: str | None, local_manifest: bytes) -> None:
    """A different conversion's manifest must not outlive the first overwritten file."""
    try:
        remote = Path(huggingface_hub.hf_hub_download(repo_id, MANIFEST_NAME, repo_type=REPO_TYPE,
                                                      revision=revision))
    except huggingface_hub.errors.EntryNotFoundError:
        return
    if remote.read_bytes() != local_manifest:
        api.delete_file(MANIFEST_NAME, repo_id, repo_type=REPO_TYPE, revision=revision,
                        commit_message="megamoe push: remove the previous manifest before replacing its files")
