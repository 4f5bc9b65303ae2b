"""``megamoe push``: a finished conversion uploaded to a Hugging Face hub model repo.

Uploads go through ``HfApi``, and only what ``manifest.json`` lists (plus the non-expert index) goes up,
then the manifest and a generated model card (:mod:`.hub_card`) in one last commit: on the hub as on
disk, a ``manifest.json`` means every file it lists is there. A different manifest already in the repo
is deleted first.

Apart from :mod:`.hub`, which reads from the hub (sources, pulls) and whose repo ids, error messages and
file checks this builds on: nothing that reads a conversion back needs the upload.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

import huggingface_hub
import huggingface_hub.errors

from megamoe_convert import __version__, jsonio
from megamoe_convert.errors import HubError
from megamoe_convert.hub.card import CARD_NAME, model_card
from megamoe_convert.hub.pull import REPO_TYPE, _describe, _hub_errors, parse_repo_ref, verify_files
from megamoe_convert.output import ranged
from megamoe_convert.output.manifest import Manifest, read_manifest
from megamoe_convert.output.naming import MANIFEST_NAME
from megamoe_convert.source.checkpoint import INDEX_NAME


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
    if os.path.lexists(ranged.record_path(out)):  # holes are never published as experts
        raise HubError(f"not pushing {out}: it holds a ranged pull ({ranged.record_path(out)}): its store files "
                       "have only the byte ranges some ranks read, not a complete store; push the store it came from")
    if parse_repo_ref(repo_id) is None or "@" in repo_id:
        raise HubError(f"{repo_id}: not a Hugging Face repo id (expected owner/name; use --revision for a branch)")
    where = f"{repo_id}@{revision or 'main'}"
    verify_files(out, manifest.files, verify, str(out / MANIFEST_NAME), refusing=f"not pushing {out}: ")
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
