"""``megamoe preload``: vLLM's weight-cache daemons serving a conversion
(:mod:`megamoe_convert.engines.vllm.preload`)."""

from __future__ import annotations

from typing import Annotated

import typer

from megamoe_convert.cli._run import run_command

#: ``app.command`` settings: every option ``megamoe preload`` does not know is vLLM's own.
SETTINGS = {"context_settings": {"allow_extra_args": True, "ignore_unknown_options": True},
            "epilog": "Every other option is vLLM's own `vllm preload` option (see `vllm preload --help`). "
                      "Then: vllm serve OUT --load-format ipc_cache"}


def preload(
    ctx: typer.Context,
    model: Annotated[str, typer.Option("--model", help="Converted directory (output of `megamoe convert`).")],
) -> None:
    """Start vLLM's weight-cache daemons (vLLM >= 0.33, one per GPU) from a conversion's pre-baked
    shards, so engines started with --load-format ipc_cache map the experts with no disk read.
    Refuses redundant experts, EPLB and NVFP4 (the weight cache cannot carry them).
    \f
    Examples::

        megamoe preload --model V4-Flash-ep8 --data-parallel-size 8 \\
            --enable-expert-parallel --moe-backend deep_gemm_mega_moe
        vllm serve V4-Flash-ep8 --load-format ipc_cache \\
            --data-parallel-size 8 --enable-expert-parallel \\
            --moe-backend deep_gemm_mega_moe
    """
    from megamoe_convert.engines.vllm.preload import run_preload

    run_command(lambda: run_preload(model, ctx.args))
