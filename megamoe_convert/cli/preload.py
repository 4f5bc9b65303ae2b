"""``megamoe preload`` (registered into the main app by cli/__init__.py): vLLM 0.33's weight-cache daemons
serving a conversion (:mod:`megamoe_convert.engines.vllm_preload`)."""

from __future__ import annotations

from typing import Annotated, Any, Callable

import typer


def register(app: typer.Typer, run_command: Callable[[Callable[[], Any]], Any],
             print_json: Callable[[Any], None]) -> None:
    """Add ``preload`` to ``app``."""

    @app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
                 epilog="Every other option is vLLM's own `vllm preload` option (see `vllm preload --help`). "
                        "Then: vllm serve OUT --load-format ipc_cache")
    def preload(
        ctx: typer.Context,
        model: Annotated[str, typer.Option("--model", help="Converted directory (output of `megamoe convert`).")],
    ) -> None:
        """Start vLLM's weight-cache daemons (vLLM >= 0.33, one per GPU) from a conversion's pre-baked
        shards, so engines started with --load-format ipc_cache map the experts with no disk read.
        Refuses redundant experts, EPLB and NVFP4 (the weight cache cannot carry them)."""
        from megamoe_convert.engines.vllm_preload import run_preload

        run_command(lambda: run_preload(model, ctx.args))
