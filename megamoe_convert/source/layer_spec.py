"""The ``--layers`` selection (``"0-3,7,mtp"``) of MoE layers, and the short ``0-2,5`` form error messages
list layer and rank numbers in.

Apart from ``checkpoint`` because it is an option's grammar, not a reading of a checkpoint: a conversion's
plan picks its layers with it from a checkpoint's, and the loader from a manifest's, each raising its own
error class.
"""

from __future__ import annotations

from typing import Sequence

from megamoe_convert import jsonio
from megamoe_convert.errors import CheckpointError, MegamoeError, PlacementError
from megamoe_convert.source.layers import MoELayer


def parse_layer_spec(available: Sequence[MoELayer], spec: str | None, where: object,
                     error: type[MegamoeError] = CheckpointError) -> list[MoELayer]:
    """``"0-3,7,mtp"``-style layer selection (``--layers``, ``load_rank(layers=...)``): decoder
    indices and ranges, ``layers.K`` / ``mtp.K`` (also as ``....ffn.experts`` prefixes), ``mtp``
    for every MTP layer. ``None``, ``""`` or ``"all"``: every layer. Each layer must be one of
    ``available`` (of ``where``), and the selection must not be empty; a problem is ``error``
    (the caller's class: a conversion's option, a loader's argument)."""
    if spec is None or spec.strip() in ("", "all"):
        return list(available)
    # Ranges are bounded by the last decoder layer before they are expanded.
    last_decoder = max((layer.index for layer in available if not layer.is_mtp), default=0)
    chosen: set[MoELayer] = set()
    for part in (p.strip() for p in spec.split(",")):
        if part == "mtp":
            chosen.update(layer for layer in available if layer.is_mtp)
            continue
        if part.startswith(("mtp.", "layers.")):
            try:
                picked = {MoELayer.parse(part.removesuffix(".ffn.experts"))}
            except ValueError:
                raise error(f"--layers: cannot parse {part!r} (expected e.g. 0-3,7,mtp.0)") from None
        else:
            decoders = _ranges([layer.index for layer in available if not layer.is_mtp])
            first, last = parse_range(part, "--layers", "0-3,7,mtp.0", last_decoder, error,
                                      f" (MoE layers of {where}: {decoders})")
            picked = {MoELayer(False, i) for i in range(first, last + 1)}
        missing = sorted(picked - set(available))
        if missing:
            raise error(f"--layers: {missing[0].key} is not an MoE layer of {where}")
        chosen |= picked
    if not chosen:
        raise error(f"--layers {spec}: selects no MoE layer of {where} "
                    f"(it has {', '.join(layer.key for layer in available)})")
    return sorted(chosen)


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2,5'`` for short error messages."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}-{v}" if v != start else f"{v}")
            start = None
    return ",".join(out)

def parse_range(part: str, flag: str, example: str, limit: int, error: type[Exception] = PlacementError,
                context: str = "") -> tuple[int, int]:
    """``"3"`` -> ``(3, 3)``, ``"3-5"`` -> ``(3, 5)``; anything else (``"3-"``, ``"5-3"``, ``"x"``) is
    an error, and so is any bound outside ``0..limit``: checked before anything is expanded. A
    problem is ``error`` (the caller's class), its message ending with ``context``."""
    lo, dash, hi = part.partition("-")
    bounds = (lo, hi) if dash else (lo,)
    # the one strict parser's digits: ASCII only ('²' passes str.isdigit, '٣' passes int)
    if not all(jsonio.is_uint(b) and int(b) < 10**9 for b in bounds):
        raise error(f"{flag}: cannot parse {jsonio.one_line(repr(part))} (expected e.g. {example}){context}")
    first, last = int(lo), int(bounds[-1])
    if first > last:
        raise error(f"{flag}: {part!r} is an empty range (write it low-high, e.g. {last}-{first}){context}")
    if last > limit:
        raise error(f"{flag}: {part!r} is outside 0..{limit}{context}")
    return first, last
