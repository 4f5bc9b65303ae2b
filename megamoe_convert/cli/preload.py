"""``megamoe preload``: an engine's weight-cache daemons serving a conversion, the engine chosen by the
conversion's manifest or ``--engine`` (:mod:`megamoe_convert.engines.vllm.preload`,
:mod:`megamoe_convert.engines.sglang.preload`)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from megamoe_convert.cli._run import run_command

#: ``app.command`` settings: every option ``megamoe preload`` does not know is the engine's own.
SETTINGS = {"context_settings": {"allow_extra_args": True, "ignore_unknown_options": True},
            "epilog": "Every other option is the engine's own: vLLM's `vllm preload` options, or SGLang's "
                      "`python -m sglang.srt.weight_cache.daemon` options. Then: vllm serve OUT --load-format "
                      "ipc_cache, or python -m sglang.launch_server --model-path OUT --weight-cache-mode client"}


def preload(
    ctx: typer.Context,
    model: Annotated[str, typer.Option("--model", help="Converted directory (output of `megamoe convert`).")],
    engine: Annotated[Optional[str], typer.Option(  # noqa: UP045 (typer reads the annotation)
        "--engine", help="vllm or sglang; default: the engine the conversion was made for (a store: the "
                         "engine that serves its family).")] = None,
) -> None:
    """Start an engine's weight-cache daemons (one per GPU) from a conversion's pre-baked shards,
    each rank reading only its own experts, so engines started later map them with no disk read:
    vLLM >= 0.33 (--load-format ipc_cache; refuses redundant experts, EPLB and NVFP4) or SGLang
    0.5.23 (--weight-cache-mode client).
    \f
    Examples::

        megamoe preload --model V4-Flash-ep8 --data-parallel-size 8 \\
            --enable-expert-parallel --moe-backend deep_gemm_mega_moe
        vllm serve V4-Flash-ep8 --load-format ipc_cache \\
            --data-parallel-size 8 --enable-expert-parallel \\
            --moe-backend deep_gemm_mega_moe
        megamoe preload --model V3-sgl-ep8 --tp-size 8 --ep-size 8 \\
            --moe-a2a-backend megamoe
        python -m sglang.launch_server --model-path V3-sgl-ep8 \\
            --weight-cache-mode client --tp-size 8 --ep-size 8 \\
            --moe-a2a-backend megamoe
    """

    def body() -> None:
        if chosen_engine(model, engine) == "sglang":
            from megamoe_convert.engines.sglang.preload import run_preload as run_sglang

            run_sglang(model, ctx.args)
            return
        from megamoe_convert.engines.vllm.preload import run_preload

        refuse_unserved(model)
        run_preload(model, ctx.args)
    run_command(body)


def chosen_engine(model: str, engine: str | None) -> str:
    """``--engine``, else the engine the conversion's manifest names, else (a store) the one that
    serves its family; an ``--engine`` other than the conversion's placement is refused."""
    from megamoe_convert.errors import PreloadError
    from megamoe_convert.hub.resolve import open_converted
    from megamoe_convert.output.naming import ANY_ENGINE
    from megamoe_convert.source import engines_table

    if engine is not None and engine not in engines_table.ENGINE_NAMES:
        raise PreloadError(f"--engine {engine}: expected one of {', '.join(engines_table.ENGINE_NAMES)}")
    converted = open_converted(model, ())
    made_for = converted.manifest.engine
    if made_for != ANY_ENGINE:
        if engine not in (None, made_for):
            raise PreloadError(f"{model}: converted for {made_for}'s expert placement, not {engine}'s; preload it "
                               f"with --engine {made_for}, or convert with --engine {engine}")
        return made_for
    return engines_table.resolve_engine(converted.family, engine)


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
