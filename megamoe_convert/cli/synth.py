"""``megamoe synth``: a random checkpoint of a supported model family, to try the tool without one."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from megamoe_convert.cli._run import run_command
from megamoe_convert.source.families import FAMILIES, detect
from megamoe_convert.synth.presets import PRESETS, load_preset
from megamoe_convert.ui import ByteProgress, status

#: The weight formats some family's checkpoints come in, in the families' order (read off the family
#: table, which needs no torch: ``megamoe synth -h`` lists them).
FORMATS = tuple(dict.fromkeys(name for family in FAMILIES for name in family.weight_formats))

#: ``synth`` presets (``configs/``, ``synth.PRESETS``): DeepSeek-V4 tiny / Flash / Pro, DeepSeek-V4.1 tiny / Flash,
#: Kimi-K3, DeepSeek-V3, Qwen3-MoE and GLM-4.5, each tiny / full. Built from the preset table, which a
#: type checker cannot enumerate (hence the ignores here and on its default below).
Preset = Enum(  # type: ignore[misc]
    "Preset", {name.replace("-", "_").replace(".", "_"): name for name in PRESETS}, type=str)


class WeightDtype(str, Enum):
    int8 = "int8"
    uint8 = "uint8"
    float4 = "float4"


class ScaleDtype(str, Enum):
    e8m0 = "e8m0"
    uint8 = "uint8"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def _presets_by_family() -> str:
    """Every preset under its family (read off the preset's own config): the ``--preset`` help."""
    by_family: dict[str, list[str]] = {}
    for name in PRESETS:
        by_family.setdefault(detect(load_preset(name), name).title, []).append(name)
    return "; ".join(f"{title}: {', '.join(names)}" for title, names in by_family.items())


def _formats_by_family() -> str:
    """Each weight format with the families whose checkpoints come in it: the ``--format`` help."""
    return ", ".join(f"{name} ({', '.join(f.title for f in FAMILIES if name in f.weight_formats)})"
                     for name in FORMATS)


def synth(
    out: Annotated[Path, typer.Argument(help="Directory to write the checkpoint into.")],
    preset: Annotated[Preset, typer.Option(help=f"Model family and dimensions ({_presets_by_family()}): the "
                                                "real models' dims, *-tiny for tests; cut real ones down with "
                                                "--layers/--experts.")
                      ] = Preset.tiny,  # type: ignore[attr-defined]
    layers: Annotated[Optional[int], typer.Option(min=1, help="Decoder layers (default: the preset's).")] = None,
    experts: Annotated[Optional[int], typer.Option(
        min=1, help="Routed experts per layer (default: the preset's).")] = None,
    mtp_layers: Annotated[Optional[int], typer.Option(min=0, help="MTP blocks (default: the preset's).")] = None,
    seed: Annotated[int, typer.Option(min=0, help="Random seed (same seed, same bytes).")] = 0,
    weight_format: Annotated[Optional[str], typer.Option(
        "--format", metavar="|".join(FORMATS), help=f"Routed experts' MegaMoE weight format, and the families whose "
                                                    f"checkpoints come in it: {_formats_by_family()}; default: "
                                                    "the family's own.")] = None,
    weight_dtype: Annotated[Optional[WeightDtype], typer.Option(
        help="Stored dtype of packed FP4 expert weights (mxfp4; default int8).")] = None,
    scale_dtype: Annotated[Optional[ScaleDtype], typer.Option(
        metavar="|".join(d.value for d in ScaleDtype),
        help="Stored dtype of expert scales: e8m0 or uint8 for mxfp4's UE8M0 (default e8m0); float32, bfloat16 or "
             "float16 for fp8_block's 128x128 block scales (default float32).")] = None,
    shard_mb: Annotated[Optional[float], typer.Option(min=0.001, help="Shard size in MB (default: 0.4 of a layer's "
                                                           "experts, so layers span shards).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace OUT if it is not empty.")] = False,
) -> None:
    """Write a random checkpoint of a supported model family (real tensor names and weight formats,
    size-cut shards).
    \f
    Examples::

        # a tiny DeepSeek-V4 checkpoint, in seconds
        megamoe synth demo/ckpt
        # real DeepSeek-V4-Flash dims, cut to fit a laptop
        megamoe synth flash-cut --preset flash --layers 2 --experts 16
        megamoe synth kimi --preset kimi-k3-tiny --seed 1
        megamoe synth v3 --preset deepseek-v3-tiny --format fp8_block
    """
    from megamoe_convert.source.families import detect
    from megamoe_convert.synth.write import synthesize

    def body() -> None:
        with ByteProgress(f"synth {preset.value}") as progress:
            config = synthesize(out, preset.value, layers=layers, experts=experts, mtp_layers=mtp_layers, seed=seed,
                                weight_format=weight_format, weight_dtype=weight_dtype and weight_dtype.value,
                                scale_dtype=scale_dtype and scale_dtype.value,
                                shard_bytes=int(shard_mb * 1e6) if shard_mb else None,
                                progress=progress, overwrite=overwrite)
        family = detect(config, preset.value)
        text, keys = family.text(config), family.keys
        status(f"wrote {out} ({family.title}: {text[keys['layers']]} layers + "
               f"{text.get(keys['mtp_layers'], 0)} MTP, {text[keys['experts']]} experts, "
               f"H={text[keys['hidden']]}"
               f"{'' if keys['hidden'] == 'hidden_size' else ' (' + keys['hidden'] + ')'}, "
               f"I={text[keys['intermediate']]})")
    run_command(body)
