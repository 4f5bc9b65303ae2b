"""vLLM's weight cache serving a conversion: the cache key and ``--load-format ipc_cache``'s fallback.

vLLM's ``vllm preload`` spawns one daemon per GPU (``weight_cache/daemon.py``: ``_run_daemon``);
each loads the model once with the configured load format, post-processes it and serves its
tensors over CUDA IPC to engines started with ``--load-format ipc_cache``, which build the model
on ``meta`` and register the daemon's tensors in place of its parameters. Besides the daemons
themselves (``megamoe preload``: :mod:`.preload`), two things stand between that and a
conversion, each handled here by :func:`register` (run by the ``vllm.general_plugins`` entry
point, :mod:`.plugin`, so in the engine and in every daemon):

- **the cache key** (``WeightCacheKey.checkpoint``) hashes only the top-level ``*.safetensors``
  headers, which are the same for every conversion of one source: vLLM's ``hash_checkpoint`` is
  extended with :func:`conversion_fingerprint`: the sealed manifest (every rank file's size and
  checksum) and every rank file's header.
- **the fallback**: an engine whose daemon is unreachable, still loading or of another key loads
  from disk with ``DefaultModelLoader("auto")``, which on a conversion reads no experts. The
  ``ipc_cache`` loader registered here falls back to ``--load-format megamoe`` instead.

What the weight cache cannot carry (:func:`ipc_refusal`) is never mapped from a daemon, and
``megamoe preload`` refuses it in one line before any daemon loads: redundant experts (they need
EPLB, which the daemon and the IPC loader refuse) and formats with per-expert global scales
(NVFP4: the kernel's L2 activation scale is a plain attribute of the experts module, not a
tensor, so an engine mapping the daemon's tensors would run with 1.0). An engine never maps such
a conversion from a daemon: it loads it from disk. vLLM's private names this needs are in
:mod:`.private_hooks`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import struct
from pathlib import Path
from typing import Any, Callable

from megamoe_convert.engines.load_formats import LOAD_FORMAT
from megamoe_convert.engines.vllm import private_hooks
from megamoe_convert.output.naming import MANIFEST_NAME, RANK_DIR, STORE_DIR

__all__ = ["conversion_fingerprint", "ipc_refusal", "register", "with_conversion"]

log = logging.getLogger(__name__)

#: What the extended cache key mixes in, so a conversion's key never equals a plain hash.
KEY_TAG = b"megamoe-convert conversion\0"


def _header(path: Path) -> bytes:
    """A safetensors file's length prefix and JSON header (what vLLM's own key hashes)."""
    with open(path, "rb") as f:
        size = f.read(8)
        if len(size) < 8:
            return size
        return size + f.read(struct.unpack("<Q", size)[0])


def conversion_fingerprint(model: str | Path) -> bytes | None:
    """The manifest's bytes (it lists every rank file with its size and checksum) and every rank
    file's (or a store's layer file's) header; None when ``model`` is no local conversion (a hub
    id, a plain checkpoint)."""
    root = Path(model)
    manifest = root / MANIFEST_NAME
    if not root.is_dir() or not manifest.is_file():
        return None
    digest = hashlib.sha256(KEY_TAG)
    digest.update(manifest.read_bytes())
    for rank_dir in sorted(p for p in root.iterdir() if p.is_dir() and (RANK_DIR.fullmatch(p.name)
                                                                         or p.name == STORE_DIR)):
        for path in sorted(rank_dir.glob("*.safetensors")):
            digest.update(f"{rank_dir.name}/{path.name}\0".encode())
            digest.update(_header(path))
    return digest.digest()


def with_conversion(hash_checkpoint: Callable[[str], str | None]) -> Callable[[str], str | None]:
    """vLLM's ``hash_checkpoint``, extended with :func:`conversion_fingerprint` on a conversion."""
    if getattr(hash_checkpoint, "megamoe", False):
        return hash_checkpoint

    @functools.wraps(hash_checkpoint)
    def hash_conversion(model: str) -> str | None:
        plain = hash_checkpoint(model)
        extra = conversion_fingerprint(model)
        if extra is None:
            return plain
        return hashlib.sha256((plain or str(model)).encode() + extra).hexdigest()

    # a second registration leaves it as it is; setattr, as a function declares no such attribute
    setattr(hash_conversion, "megamoe", True)  # noqa: B010
    return hash_conversion


def ipc_refusal(converted: Any) -> str | None:
    """Why an engine must not map this conversion's experts from a daemon (None: it may)."""
    manifest = converted.manifest
    fmt = manifest.dims.format
    if fmt.global_scales:
        return (f"{converted.path}: {fmt.name.upper()} experts: vLLM's weight cache does not carry their L2 activation "
                "scale (a plain attribute of the experts module, not a tensor); serve with --load-format megamoe")
    redundant = len(manifest.placement.physical_to_logical) - manifest.placement.n_logical
    if redundant:
        return (f"{converted.path}: converted with {redundant} redundant experts, which need EPLB, and vLLM's "
                "weight-cache daemon refuses EPLB; convert again with --num-redundant-experts 0, or serve with "
                "--load-format megamoe")
    return None


def register() -> None:
    """The weight cache's part of the plugin: the extended cache key, and an ``ipc_cache`` loader
    that never maps what the weight cache cannot carry and whose disk fallback serves a
    conversion's experts (no-op in a vLLM without the weight cache)."""
    if private_hooks.weight_cache("protocol") is None:
        return
    from vllm.model_executor.model_loader import register_model_loader

    private_hooks.extend_checkpoint_hash(with_conversion)
    register_model_loader("ipc_cache")(private_hooks.ipc_loader_class(_ipc_refusal, _fallback_format))


def _ipc_refusal(model: str) -> str | None:
    """Why an engine must not map ``model``'s experts from a daemon (None: no conversion, or it may)."""
    converted = _conversion(model)
    return ipc_refusal(converted) if converted is not None else None


def _fallback_format(model: str) -> str | None:
    """The load format the ``ipc_cache`` disk fallback uses for ``model``: ``megamoe`` on a conversion."""
    if _conversion(model) is None:
        return None
    log.warning("megamoe: %s is a conversion: the disk fallback loads it with --load-format %s", model, LOAD_FORMAT)
    return LOAD_FORMAT


def _conversion(model: str) -> Any:
    """The opened conversion at ``model`` (a local directory with a manifest), else None."""
    if not (Path(model) / MANIFEST_NAME).is_file():
        return None
    from megamoe_convert.hub.resolve import open_converted  # at first use: the plugin stays light

    return open_converted(model, ())
