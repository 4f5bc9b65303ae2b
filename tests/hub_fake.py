"""A file-based stand-in for the few Hugging Face hub calls megamoe makes (no network).

Server side: repos under ``root``, each commit a full directory snapshot, branches in
``refs``. Client side: downloads land in the *real* HF cache layout
(``models--owner--name/{blobs,snapshots/<commit>,refs/<branch>}``), so what a fake pull
leaves in the cache is what the real ``huggingface_hub`` reads in offline mode, and
pattern filtering is done by the library's own ``filter_repo_objects``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import huggingface_hub
from huggingface_hub import errors
from huggingface_hub.utils import filter_repo_objects

COMMIT = re.compile(r"^[0-9a-f]{40}$")


def _response(status: int, url: str) -> httpx2.Response:
    return httpx2.Response(status, request=httpx2.Request("GET", url))


@dataclass
class CommitInfo:
    oid: str
    commit_message: str


def cache_put(cache: Path, repo_id: str, commit: str, files: dict[str, Path], revision: str | None = "main") -> Path:
    """Put files into an HF cache exactly as huggingface_hub lays it out; returns the snapshot."""
    storage = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    for rel, src in files.items():
        data = Path(src).read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    snapshot.mkdir(parents=True, exist_ok=True)
    if revision and not COMMIT.match(revision):
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / revision).write_text(commit)
    return snapshot


class FakeHub:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.repos: dict[str, dict[str, Any]] = {}  # repo_id -> {"refs": {...}, "private": bool}
        self.commits: list[tuple[str, str, list[str]]] = []  # (repo_id, message, paths changed), in order
        self.downloaded: list[str] = []  # every file path a download brought into a cache or local dir
        self.ranged: list[tuple[str, int, int]] = []  # every range request: (path, offset, bytes)

    # ------------------------------------------------------------------ server side
    def _repo(self, repo_id: str) -> dict[str, Any]:
        if repo_id not in self.repos:
            raise errors.RepositoryNotFoundError(f"404: {repo_id} not found",
                                                 response=_response(404, f"https://hf.fake/{repo_id}"))
        return self.repos[repo_id]

    def snapshot_dir(self, repo_id: str, commit: str) -> Path:
        return self.root / repo_id.replace("/", "--") / commit

    def resolve(self, repo_id: str, revision: str | None) -> str:
        repo = self._repo(repo_id)
        revision = revision or "main"
        if COMMIT.match(revision) and self.snapshot_dir(repo_id, revision).is_dir():
            return revision
        if revision not in repo["refs"]:
            raise errors.RevisionNotFoundError(f"404: revision {revision} not found",
                                               response=_response(404, f"https://hf.fake/{repo_id}"))
        return repo["refs"][revision]

    def files(self, repo_id: str, revision: str | None = None) -> dict[str, Path]:
        snap = self.snapshot_dir(repo_id, self.resolve(repo_id, revision))
        return {p.relative_to(snap).as_posix(): p for p in sorted(snap.rglob("*")) if p.is_file()}

    def commit(self, repo_id: str, revision: str | None, changes: dict[str, bytes | Path | None],
               message: str) -> CommitInfo:
        repo = self._repo(repo_id)
        branch = revision or "main"
        parent = repo["refs"].get(branch)
        if parent is None:
            raise errors.RevisionNotFoundError(f"404: branch {branch} not found",
                                               response=_response(404, f"https://hf.fake/{repo_id}"))
        digest = hashlib.sha1(f"{parent}{message}{len(self.commits)}".encode())
        for path in sorted(changes):
            digest.update(path.encode())
        sha = digest.hexdigest()
        new = self.snapshot_dir(repo_id, sha)
        shutil.copytree(self.snapshot_dir(repo_id, parent), new)
        for path, content in changes.items():
            target = new / path
            if content is None:
                target.unlink()
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content if isinstance(content, bytes) else Path(content).read_bytes())
        repo["refs"][branch] = sha
        self.commits.append((repo_id, message, sorted(changes)))
        return CommitInfo(sha, message)

    # ------------------------------------------------------------------ HfApi
    def api(self, **_: Any) -> "FakeApi":
        return FakeApi(self)

    # ------------------------------------------------------------------ downloads
    def snapshot_download(self, repo_id: str, *, repo_type: str | None = None, revision: str | None = None,
                          allow_patterns: Any = None, ignore_patterns: Any = None, local_dir: Any = None,
                          cache_dir: Any = None, force_download: bool = False, **_: Any) -> str:
        assert repo_type in (None, "model")
        commit = self.resolve(repo_id, revision)
        files = self.files(repo_id, commit)
        chosen = {p: files[p] for p in filter_repo_objects(files, allow_patterns=allow_patterns,
                                                             ignore_patterns=ignore_patterns)}
        if local_dir is not None:
            local = Path(local_dir)
            for rel, src in chosen.items():
                dst = local / rel
                if force_download or not dst.exists() or dst.read_bytes() != src.read_bytes():  # an etag check
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, dst)
                    self.downloaded.append(rel)
            local.mkdir(parents=True, exist_ok=True)
            return str(local.resolve())
        cache = Path(cache_dir or huggingface_hub.constants.HF_HUB_CACHE)
        snapshot = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit
        todo = {rel: src for rel, src in chosen.items() if force_download or not (snapshot / rel).exists()}
        self.downloaded.extend(todo)
        return str(cache_put(cache, repo_id, commit, todo, revision if revision != commit else None))

    def hf_hub_download(self, repo_id: str, filename: str, *, repo_type: str | None = None,
                        revision: str | None = None, **kw: Any) -> str:
        commit = self.resolve(repo_id, revision)
        if filename not in self.files(repo_id, commit):
            raise errors.RemoteEntryNotFoundError(f"404: {filename} not in {repo_id}",
                                                  response=_response(404, f"https://hf.fake/{repo_id}"))
        return str(Path(self.snapshot_download(repo_id, revision=revision, allow_patterns=[filename], **kw))
                   / filename)

    def cat_file(self, url: str, start: int, end: int) -> bytes:
        """``HfFileSystem.cat_file``: one HTTP range request of ``owner/name@revision/path``."""
        repo_ref, rel = "/".join(url.split("/")[:2]), "/".join(url.split("/")[2:])
        repo_id, _, revision = repo_ref.partition("@")
        files = self.files(repo_id, self.resolve(repo_id, revision or None))
        if rel not in files:
            raise FileNotFoundError(f"404: {rel} not in {repo_id}")
        with open(files[rel], "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        self.ranged.append((rel, start, len(data)))
        return data

    def install(self, monkeypatch: Any, cache: Path) -> "FakeHub":
        monkeypatch.setattr(huggingface_hub, "HfFileSystem", lambda *a, **k: self)
        monkeypatch.setattr(huggingface_hub, "HfApi", self.api)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", self.snapshot_download)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", self.hf_hub_download)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
        return self


class FakeApi:
    """The ``HfApi`` methods megamoe calls, with the library's keyword names."""

    def __init__(self, hub: FakeHub) -> None:
        self.hub = hub

    def create_repo(self, repo_id: str, *, repo_type: str | None = None, private: bool | None = None,
                    exist_ok: bool = False, **_: Any) -> str:
        if repo_id in self.hub.repos:
            if not exist_ok:
                raise errors.HfHubHTTPError("409: repo exists", response=_response(409, "https://hf.fake"))
        else:
            self.hub.repos[repo_id] = {"refs": {}, "private": bool(private)}
            sha = hashlib.sha1(repo_id.encode()).hexdigest()
            init = self.hub.snapshot_dir(repo_id, sha)
            init.mkdir(parents=True)
            (init / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
            self.hub.repos[repo_id]["refs"]["main"] = sha
        return f"https://hf.fake/{repo_id}"

    def create_branch(self, repo_id: str, *, branch: str, revision: str | None = None, exist_ok: bool = False,
                      **_: Any) -> None:
        repo = self.hub._repo(repo_id)
        if branch in repo["refs"]:
            if not exist_ok:
                raise errors.HfHubHTTPError("409: branch exists", response=_response(409, "https://hf.fake"))
            return
        repo["refs"][branch] = self.hub.resolve(repo_id, revision)

    def upload_folder(self, *, repo_id: str, folder_path: Any, repo_type: str | None = None,
                      revision: str | None = None, allow_patterns: Any = None, ignore_patterns: Any = None,
                      commit_message: str | None = None, **_: Any) -> CommitInfo:
        folder = Path(folder_path)
        rels = [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*")) if p.is_file()]
        chosen = list(filter_repo_objects(rels, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        return self.hub.commit(repo_id, revision, {rel: folder / rel for rel in chosen},
                               commit_message or "Upload folder")

    def create_commit(self, repo_id: str, operations: Any, *, commit_message: str, repo_type: str | None = None,
                      revision: str | None = None, **_: Any) -> CommitInfo:
        changes: dict[str, bytes | Path | None] = {}
        for op in operations:
            if isinstance(op, huggingface_hub.CommitOperationDelete):
                changes[op.path_in_repo] = None
            else:
                content = op.path_or_fileobj
                changes[op.path_in_repo] = content if isinstance(content, bytes) else Path(content)
        return self.hub.commit(repo_id, revision, changes, commit_message)

    def delete_file(self, path_in_repo: str, repo_id: str, *, repo_type: str | None = None,
                    revision: str | None = None, commit_message: str | None = None, **_: Any) -> CommitInfo:
        return self.hub.commit(repo_id, revision, {path_in_repo: None}, commit_message or f"Delete {path_in_repo}")
