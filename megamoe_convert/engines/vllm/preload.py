"""``megamoe preload``: vLLM's own ``vllm preload`` serving a conversion, with megamoe-convert in each daemon.

vLLM's daemons never load ``vllm.general_plugins``, so ``--load-format megamoe`` is unknown in
them. :func:`run_preload` refuses what the weight cache cannot carry (:func:`check_daemon_servable`),
then runs vLLM's own ``PreloadSubcommand.cmd`` with :func:`daemon_entry` as the spawned target: it
registers megamoe-convert in the daemon (:func:`prepare_daemon`), then runs vLLM's own
``_run_daemon``. ``spawn`` pickles the target by reference, so it is a module-level function of
this importable module. The cache key and the ``ipc_cache`` loader: :mod:`.weight_cache`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from megamoe_convert.engines.driver import require_engine
from megamoe_convert.engines.load_formats import LOAD_FORMAT
from megamoe_convert.engines.vllm import plugin, private_hooks
from megamoe_convert.engines.vllm.weight_cache import ipc_refusal
from megamoe_convert.errors import PreloadError
from megamoe_convert.hub.resolve import open_converted

__all__ = ["check_daemon_servable", "daemon_entry", "prepare_daemon", "run_preload"]


def check_daemon_servable(model: str | Path) -> None:
    """Refuse what ``megamoe preload`` must not start daemons for: no conversion, or one of another
    engine's placement (as opening and installing it would), or one the weight cache cannot carry."""
    converted = open_converted(model, ())
    if not converted.manifest.store:  # a store holds no engine's placement: vLLM's is read at install
        require_engine(converted, "vllm")
    if converted.manifest.experts_only:
        raise PreloadError(f"{converted.path}: converted with --experts-only, so it holds no non-expert weights to "
                           "serve; convert without --experts-only")
    refusal = ipc_refusal(converted)
    if refusal:
        raise PreloadError(refusal)


def prepare_daemon() -> None:
    """In a spawned daemon: the general plugins, as an engine worker loads them, and
    megamoe-convert's registration even where its entry point is not installed."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    plugin.register()  # once per process: a no-op when the entry point above already ran it


#: vLLM's own ``_run_daemon``, kept when :func:`run_preload` hands vLLM :func:`daemon_entry` instead.
_vllm_run_daemon: Callable[..., None] | None = None


def daemon_entry(*args: Any, **kwargs: Any) -> None:
    """The spawned daemon's target: megamoe-convert registered, then vLLM's own ``_run_daemon``."""
    prepare_daemon()
    run = private_hooks.daemon_target()
    if run is daemon_entry:  # a forked child inherits the parent's swap
        assert _vllm_run_daemon is not None  # kept by run_preload before the swap
        run = _vllm_run_daemon
    run(*args, **kwargs)


def preload_parser(prog: str = "megamoe preload") -> Any:
    """vLLM's own ``vllm preload`` argument parser."""
    try:
        from vllm.entrypoints.cli.preload import PreloadSubcommand
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as e:
        raise PreloadError(f"megamoe preload needs vLLM >= 0.33, which {sys.executable} cannot import ({e}): run it "
                           "with the python of vLLM's environment, megamoe-convert installed there too: "
                           "VLLM_ENV/bin/python -m megamoe_convert.cli preload --model OUT ...") from None
    parser = FlexibleArgumentParser(prog=prog, description="vLLM's `vllm preload`, serving a conversion.")
    PreloadSubcommand.add_cli_args(parser)
    return parser


def run_preload(model: str, argv: Sequence[str] = ()) -> None:
    """``vllm preload --model MODEL ARGV`` with ``--load-format megamoe`` in every daemon, after
    the refusals (the conversion's before vLLM is even imported); it returns only through
    ``sys.exit`` (vLLM's own ``cmd`` ends there) or an error."""
    global _vllm_run_daemon
    check_daemon_servable(model)
    args = preload_parser().parse_args(["--model", str(model), *argv])
    if args.load_format not in ("auto", LOAD_FORMAT):
        raise PreloadError(f"--load-format {args.load_format}: megamoe preload loads a conversion with "
                           f"--load-format {LOAD_FORMAT}; leave the flag out")
    if args.enable_eplb:
        raise PreloadError("--enable-eplb: vLLM's weight-cache daemon does not support EPLB; leave the flag out")
    args.load_format = LOAD_FORMAT
    from vllm.entrypoints.cli.preload import PreloadSubcommand

    plugin.register()  # this process builds the engine config: the load format must be known here too
    with private_hooks.replaced_daemon_target(daemon_entry) as _vllm_run_daemon:
        PreloadSubcommand.cmd(args)
