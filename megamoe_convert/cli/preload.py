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

    def body() -> None:
        refuse_unserved(model)
        run_preload(model, ctx.args)
    run_command(body)


def refuse_unserved(model: str) -> None:
    """A conversion of a family vLLM does not serve: the daemon is vLLM's only, so it is refused
    naming the engine that serves it (a conversion for that engine's placement is its own)."""
    from megamoe_convert.errors import PreloadError
    from megamoe_convert.hub.resolve import open_converted
    from megamoe_convert.source import engines_table

    converted = open_converted(model, ())
    family, d = converted.family, converted.manifest.dims
    if (why := engines_table.family_refusal(family, "vllm")) is None:
        return
    served = " or ".join(engines_table.served_by(e, family, d.weight_format, d.hidden_size, d.moe_intermediate_size)
                         for e in engines_table.engines_for(family))
    instead = (f"serve it with {served} (megamoe inspect {model} prints the command)" if served else
               engines_table.unserved_note(family))
    raise PreloadError(f"{model}: a conversion of {family.title}, which vLLM cannot serve ({why}); megamoe preload "
                       f"starts vLLM's weight-cache daemons only: {instead}")
