"""``megamoe preload`` for SGLang (0.5.23): SGLang's own weight-cache daemons serving a conversion.

SGLang's standalone daemon (``python -m sglang.srt.weight_cache.daemon``) spawns one daemon per
local rank without loading ``sglang.srt.plugins``, so a conversion's marker config would be refused
in it. :func:`run_preload` refuses what no daemon may serve (:func:`check_daemon_servable`), builds
SGLang's own server args and daemon args from the command line exactly as the daemon's ``__main__``
does, and runs SGLang's own launcher with :func:`daemon_entry` as the spawned target: it loads the
plugins in the daemon (:func:`prepare_daemon`), then runs SGLang's own ``run_weight_cache_daemon``.
Each daemon then loads its rank with SGLang's default loader, whose hooked ``load_weights`` installs
that rank's experts only (:mod:`.model_classes`). Engines map them with ``--weight-cache-mode
client`` (:mod:`.weight_cache`). ``spawn`` pickles the target by reference, so it is a module-level
function of this importable module.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from megamoe_convert.engines.driver import require_engine
from megamoe_convert.engines.sglang import plugin, private_hooks
from megamoe_convert.errors import PreloadError
from megamoe_convert.hub.resolve import open_converted
from megamoe_convert.source import engines_table

__all__ = ["check_daemon_servable", "daemon_entry", "prepare_daemon", "run_preload"]

#: The load formats a daemon may read a conversion with (each installs its experts).
DAEMON_FORMATS = ("auto", "safetensors", "megamoe")


def check_daemon_servable(model: str | Path) -> None:
    """Refuse what no SGLang daemon may load: no conversion, a family SGLang does not serve,
    per-rank files of another engine's placement, an ``--experts-only`` conversion."""
    converted = open_converted(model, ())
    if (why := engines_table.family_refusal(converted.family, "sglang")) is not None:
        raise PreloadError(f"{converted.path}: a conversion of {converted.family.title}, which SGLang does not "
                           f"serve ({why})")
    if not converted.manifest.store:  # a store holds no engine's placement: SGLang's is read at install
        require_engine(converted, "sglang")
    if converted.manifest.experts_only:
        raise PreloadError(f"{converted.path}: converted with --experts-only, so it holds no non-expert weights to "
                           "serve; convert without --experts-only")


def prepare_daemon() -> None:
    """In a daemon (and the launcher): SGLang's plugins, as its own processes load them, and
    megamoe-convert's registration even where its entry point is not installed."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    if not _entry_point_installed():  # load_plugins knew nothing of megamoe-convert: register it here
        plugin.register()


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    target = f"{plugin.__name__}:register"
    return any(ep.value == target for ep in entry_points(group="sglang.srt.plugins"))


#: SGLang's own ``run_weight_cache_daemon``, kept while :func:`run_preload` hands the launcher
#: :func:`daemon_entry` instead.
_sglang_run_daemon: Callable[..., None] | None = None


def daemon_entry(*args: Any, **kwargs: Any) -> None:
    """A daemon's target: megamoe-convert registered, then SGLang's own ``run_weight_cache_daemon``."""
    prepare_daemon()
    run = importlib.import_module(private_hooks.DAEMON_MODULE).run_weight_cache_daemon
    if run is daemon_entry:  # this process swapped it: run in place (one daemon), or a forked child
        assert _sglang_run_daemon is not None
        run = _sglang_run_daemon
    run(*args, **kwargs)


@contextmanager
def _daemon_target() -> Iterator[None]:
    """SGLang's launcher spawns :func:`daemon_entry` in place of its own target."""
    global _sglang_run_daemon
    module = importlib.import_module(private_hooks.DAEMON_MODULE)
    _sglang_run_daemon = module.run_weight_cache_daemon
    setattr(module, "run_weight_cache_daemon", daemon_entry)  # noqa: B010
    try:
        yield
    finally:
        setattr(module, "run_weight_cache_daemon", _sglang_run_daemon)  # noqa: B010


def parse(model: str, argv: Sequence[str]) -> tuple[Any, Any]:
    """SGLang's own server args and daemon args for ``--model-path MODEL ARGV``, as its daemon's
    ``__main__`` parses them."""
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.weight_cache.daemon import WeightCacheDaemonArgs

    if any(a == "--model-path" or a.startswith("--model-path=") for a in argv):
        raise PreloadError("--model-path: megamoe preload takes the conversion as --model; leave the flag out")
    worker = argparse.ArgumentParser(add_help=False)
    WeightCacheDaemonArgs.add_cli_args(worker)
    known, server_argv = worker.parse_known_args(list(argv))
    server_args = prepare_server_args(["--model-path", str(model), *server_argv])
    load_format = str(getattr(server_args, "load_format", "auto"))
    if load_format not in DAEMON_FORMATS:
        raise PreloadError(f"--load-format {load_format}: a daemon loads a conversion with one of "
                           f"{', '.join(DAEMON_FORMATS)}; leave the flag out")
    return server_args, WeightCacheDaemonArgs.from_cli_args(known)


def require_sglang() -> None:
    """SGLang's weight cache importable here, or one line saying which python to run instead."""
    try:
        importlib.import_module(private_hooks.DAEMON_MODULE)
    except ImportError as e:
        raise PreloadError(f"megamoe preload of an SGLang conversion needs SGLang 0.5.23 (its weight cache), which "
                           f"{sys.executable} cannot import ({e}): run it with the python of SGLang's environment, "
                           "megamoe-convert installed there too: SGLANG_ENV/bin/python -m megamoe_convert.cli "
                           "preload --model OUT ...") from None


def run_preload(model: str, argv: Sequence[str] = ()) -> None:
    """SGLang's own standalone daemon launch for ``--model-path MODEL ARGV``, with megamoe-convert in
    every daemon; it returns when the daemons exit (SGLang's own launcher waits on them)."""
    check_daemon_servable(model)
    require_sglang()
    prepare_daemon()  # the launcher builds server args, which read the conversion's config
    server_args, daemon_args = parse(model, argv)
    from sglang.srt.platforms import current_platform
    from sglang.srt.weight_cache import daemon, protocol

    with _daemon_target():
        if daemon_args.gpu_id is None and daemon_args.tp_rank is None:
            daemon.launch_weight_cache_daemons(server_args, dist_init_method=daemon_args.dist_init_method,
                                               timeout=daemon_args.timeout, force=daemon_args.force)
            return
        gpu_id = daemon_args.gpu_id if daemon_args.gpu_id is not None else daemon_args.tp_rank
        tp_rank = daemon_args.tp_rank if daemon_args.tp_rank is not None else daemon_args.gpu_id
        protocol.cleanup_stale_daemon_files(current_platform.get_device_uuid(gpu_id), force=daemon_args.force)
        daemon_entry(server_args, gpu_id=gpu_id, tp_rank=tp_rank, pp_rank=daemon_args.pp_rank,
                     dist_init_method=daemon_args.dist_init_method)
