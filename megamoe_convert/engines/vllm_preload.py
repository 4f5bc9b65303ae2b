"""vLLM 0.33's weight-cache daemon serving a conversion: ``megamoe preload``, the cache key and
``--load-format ipc_cache``'s fallback.

vLLM's ``vllm preload`` spawns one daemon per GPU (``weight_cache/daemon.py``: ``_run_daemon``);
each loads the model once with the configured load format, post-processes it and serves its
tensors over CUDA IPC to engines started with ``--load-format ipc_cache``, which build the model
on ``meta`` and register the daemon's tensors in place of its parameters. Three things stand
between that and a conversion, each handled here:

- **the daemons never load ``vllm.general_plugins``**, so ``--load-format megamoe`` is unknown in
  them. :func:`run_preload` runs vLLM's own ``PreloadSubcommand.cmd`` with :func:`daemon_entry`
  as the spawned target: it registers megamoe-convert in the daemon (:func:`prepare_daemon`),
  then runs vLLM's own ``_run_daemon``. ``spawn`` pickles the target by reference, so it is a
  module-level function of this importable module.
- **the cache key** (``WeightCacheKey.checkpoint``) hashes only the top-level ``*.safetensors``
  headers, which are the same for every conversion of one source. :func:`register_weight_cache`
  (run by the ``vllm.general_plugins`` entry point, so in the engine too) extends vLLM's
  ``hash_checkpoint`` with :func:`conversion_fingerprint`: the sealed manifest (every rank file's
  size and checksum) and every rank file's header.
- **the fallback**: an engine whose daemon is unreachable, still loading or of another key loads
  from disk with ``DefaultModelLoader("auto")``, which on a conversion reads no experts. The
  ``ipc_cache`` loader registered here falls back to ``--load-format megamoe`` instead.

What the weight cache cannot carry is refused in one line before any daemon loads
(:func:`daemon_refusal`): redundant experts (they need EPLB, which the daemon and the IPC loader
refuse) and formats with per-expert global scales (NVFP4: the kernel's L2 activation scale is a
plain attribute of the experts module, not a tensor, so an engine mapping the daemon's tensors
would run with 1.0). An engine never maps such a conversion from a daemon: it loads it from disk.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from pathlib import Path
from typing import Any, Callable, Sequence
from megamoe_convert.errors import PreloadError  # noqa: F401

from megamoe_convert.engines import InstallError, require_engine, vllm_loader
from megamoe_convert.engines.load_format import LOAD_FORMAT
from megamoe_convert.output.manifest import MANIFEST_NAME, RANK_DIR, STORE_DIR
from megamoe_convert.serve.errors import LoadError
from megamoe_convert.serve.loader import open_converted

__all__ = ["conversion_fingerprint", "daemon_entry", "daemon_refusal", "prepare_daemon", "register",
           "register_weight_cache", "run_preload"]

log = logging.getLogger(__name__)

#: The vLLM module holding the weight cache (absent before 0.33: nothing to register there).
WEIGHT_CACHE = "vllm.model_executor.model_loader.weight_cache"
#: What the extended cache key mixes in, so a conversion's key never equals a plain hash.
KEY_TAG = b"megamoe-convert conversion\0"


# --------------------------------------------------------------------------------------
# What tells conversions apart
# --------------------------------------------------------------------------------------

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

    def hash_conversion(model: str) -> str | None:
        plain = hash_checkpoint(model)
        extra = conversion_fingerprint(model)
        if extra is None:
            return plain
        return hashlib.sha256((plain or str(model)).encode() + extra).hexdigest()

    hash_conversion.megamoe = True  # type: ignore[attr-defined]
    hash_conversion.__wrapped__ = hash_checkpoint  # type: ignore[attr-defined]
    return hash_conversion


# --------------------------------------------------------------------------------------
# What the weight cache cannot serve
# --------------------------------------------------------------------------------------

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


def daemon_refusal(model: str | Path) -> str | None:
    """Why ``megamoe preload`` must not start daemons for ``model`` (None: it may)."""
    try:
        converted = open_converted(model, ())
        if not converted.manifest.store:  # a store holds no engine's placement: vLLM's is read at install
            require_engine(converted, "vllm")
    except (LoadError, InstallError) as e:
        return f"{e}"
    if converted.manifest.experts_only:
        return (f"{converted.path}: converted with --experts-only, so it holds no non-expert weights to serve; "
                "convert without --experts-only")
    return ipc_refusal(converted)


# --------------------------------------------------------------------------------------
# Registration: the vLLM plugin (engine) and each spawned daemon
# --------------------------------------------------------------------------------------

_registered = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point (``vllm_integration.register``): ``--load-format
    megamoe`` (:mod:`.vllm_loader`) and, vLLM >= 0.33, the weight cache's part
    (:func:`register_weight_cache`). Once per process (a spawned daemon may run it twice); no-op
    without vLLM."""
    global _registered
    if _registered:
        return
    vllm_loader.register()
    register_weight_cache()
    _registered = True


def register_weight_cache() -> None:
    """The extended cache key, and an ``ipc_cache`` loader whose disk fallback serves a
    conversion's experts. No-op before vLLM 0.33 (and without vLLM)."""
    try:
        import importlib

        protocol = importlib.import_module(f"{WEIGHT_CACHE}.protocol")
        ipc_loader = importlib.import_module(f"{WEIGHT_CACHE}.ipc_loader")
        from vllm.model_executor.model_loader import register_model_loader
    except ImportError:
        return
    protocol.hash_checkpoint = with_conversion(protocol.hash_checkpoint)
    base = ipc_loader.IpcModelLoader
    if not getattr(base, "megamoe", False):
        register_model_loader("ipc_cache")(make_ipc_loader_class(base, protocol.CacheConfigMismatchError))


def make_ipc_loader_class(base: type, mismatch: type[Exception]) -> type:
    """vLLM's ``IpcModelLoader``, except on a conversion: it never maps what the weight cache
    cannot carry (:func:`ipc_refusal`), and its disk fallback is ``--load-format megamoe``."""

    class MegaMoEIpcModelLoader(base):  # type: ignore[misc, valid-type]
        megamoe = True

        def _fetch_entries(self, model_config: Any, *args: Any, **kwargs: Any) -> Any:
            converted = _conversion(model_config.model)
            refusal = ipc_refusal(converted) if converted is not None else None
            if refusal:  # before asking any daemon: the fallback (or, without one, this error) follows
                raise mismatch(refusal)
            return super()._fetch_entries(model_config, *args, **kwargs)

        def _fallback_load(self, vllm_config: Any, model_config: Any, prefix: str) -> Any:
            if _conversion(model_config.model) is None:
                return super()._fallback_load(vllm_config, model_config, prefix)
            from vllm.model_executor.model_loader import get_model_loader

            log.warning("megamoe: %s is a conversion: the disk fallback loads it with --load-format %s",
                        model_config.model, LOAD_FORMAT)
            config = self._fallback_load_config()
            config.load_format = LOAD_FORMAT
            return get_model_loader(config).load_model(vllm_config=vllm_config, model_config=model_config,
                                                       prefix=prefix)

    return MegaMoEIpcModelLoader


def _conversion(model: str) -> Any:
    """The opened conversion at ``model`` (a local directory with a manifest), else None."""
    if not (Path(model) / MANIFEST_NAME).is_file():
        return None
    return open_converted(model, ())


def prepare_daemon() -> None:
    """In a spawned daemon: the general plugins, as an engine worker loads them, and
    megamoe-convert's registration even where its entry point is not installed."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    register()  # once per process: a no-op when the entry point above already ran it


#: vLLM's own ``_run_daemon``, kept when :func:`run_preload` hands vLLM :func:`daemon_entry` instead.
_vllm_run_daemon: Callable[..., None] | None = None


def daemon_entry(*args: Any, **kwargs: Any) -> None:
    """The spawned daemon's target: megamoe-convert registered, then vLLM's own ``_run_daemon``."""
    import importlib

    prepare_daemon()
    daemon = importlib.import_module(f"{WEIGHT_CACHE}.daemon")
    run = daemon._run_daemon
    if run is daemon_entry:  # a forked child inherits the parent's swap
        run = _vllm_run_daemon
    run(*args, **kwargs)


# --------------------------------------------------------------------------------------
# megamoe preload
# --------------------------------------------------------------------------------------

def preload_parser(prog: str = "megamoe preload") -> Any:
    """vLLM's own ``vllm preload`` argument parser."""
    try:
        from vllm.entrypoints.cli.preload import PreloadSubcommand
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as e:
        raise PreloadError(f"megamoe preload needs vLLM >= 0.33 in this environment ({e}); install "
                           "megamoe-convert into the serving engine's environment") from None
    parser = FlexibleArgumentParser(prog=prog, description="vLLM's `vllm preload`, serving a conversion.")
    PreloadSubcommand.add_cli_args(parser)
    return parser


def run_preload(model: str, argv: Sequence[str] = ()) -> None:
    """``vllm preload --model MODEL ARGV`` with ``--load-format megamoe`` in every daemon, after
    the refusals (the conversion's before vLLM is even imported); it returns only through
    ``sys.exit`` (vLLM's own ``cmd`` ends there) or an error."""
    global _vllm_run_daemon
    refusal = daemon_refusal(model)
    if refusal:
        raise PreloadError(refusal)
    args = preload_parser().parse_args(["--model", str(model), *argv])
    if args.load_format not in ("auto", LOAD_FORMAT):
        raise PreloadError(f"--load-format {args.load_format}: megamoe preload loads a conversion with "
                           f"--load-format {LOAD_FORMAT}; leave the flag out")
    if args.enable_eplb:
        raise PreloadError("--enable-eplb: vLLM's weight-cache daemon does not support EPLB; leave the flag out")
    args.load_format = LOAD_FORMAT
    import importlib

    from vllm.entrypoints.cli.preload import PreloadSubcommand

    register()  # this process builds the engine config: the load format must be known here too
    daemon = importlib.import_module(f"{WEIGHT_CACHE}.daemon")
    _vllm_run_daemon, daemon._run_daemon = daemon._run_daemon, daemon_entry  # what vLLM's cmd imports
    try:
        PreloadSubcommand.cmd(args)
    finally:
        daemon._run_daemon = _vllm_run_daemon
