"""``verify --numerics``: a reference MoE computed from the pre-baked layout against the source's, per format."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from megamoe_convert.layout import inverse
from megamoe_convert.output.compare import (
    numerics_config,
    same_values,
)
from megamoe_convert.output.manifest import Manifest
from megamoe_convert.progress import Progress
from megamoe_convert.source import formats
from megamoe_convert.source.checkpoint import Checkpoint
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import FileCache
from megamoe_convert.verify.experts import load_layer
from megamoe_convert.verify.report import VerifyReport

#: Local expert slots per rank and layer that ``--numerics`` runs: dequantised matrices are large and
#: every slot goes through the same layout code (``--source`` compares every slot's bytes), so the
#: rank's first and last slot, its edges, stand for the rest.
NUMERICS_MAX_EXPERTS = 2


def numerics_slots(n_local: int, max_experts: int, generator: torch.Generator) -> list[int]:
    """The local slots a numerics check runs: the first and the last, then random others up to ``max_experts``."""
    edges = sorted({0, n_local - 1})[:max_experts]
    others = [s for s in torch.randperm(n_local, generator=generator).tolist() if s not in edges]
    return sorted(edges + others[:max(0, max_experts - len(edges))])


# --------------------------------------------------------------------------------------
# 3. numerics
# --------------------------------------------------------------------------------------

#: ``activation(gate, up)``: the routed experts' gated activation, before the down projection.
Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def expert_activation(ckpt: Checkpoint) -> tuple[Activation, dict[str, Any]]:
    """The family's routed-expert activation with its config.json parameters (and those, for the report).

    - ``swiglu`` (DeepSeek): as vLLM's ``SiluAndMulWithClamp`` / DeepGEMM's ``activation_clamp``,
      the gate clamped from above and the up projection on both sides by ``swiglu_limit``, then
      ``silu(gate) * up``.
    - ``situ`` (Kimi-K3): as vLLM's ``SituAndMul``, ``beta * tanh(gate / beta) * sigmoid(gate)``
      times ``up``, softly clipped to ``linear_beta * tanh(up / linear_beta)`` when that is set.
    """
    config = numerics_config(ckpt)  # checked numbers, or a one-line CheckpointError
    if config.activation == "situ":
        beta, linear = config.situ_beta, config.situ_linear_beta

        def situ(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            up = linear * torch.tanh(up / linear) if linear else up
            return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * up

        return situ, {"activation": "situ", "situ_beta": beta, "situ_linear_beta": linear}
    limit = config.swiglu_limit

    def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if limit > 0:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return torch.nn.functional.silu(gate) * up

    return swiglu, {"activation": "swiglu", "swiglu_limit": limit}


def gated_mlp(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, activation: Activation,
              ) -> torch.Tensor:
    """One expert (routed or shared): ``activation(x @ w1.T, x @ w3.T) @ w2.T``."""
    return activation(x @ w1.T, x @ w3.T) @ w2.T


def reference_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  experts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                  activation: Activation) -> torch.Tensor:
    """``y = sum_k weight_k * expert_{id_k}(x)`` over the routed experts, token by token group,
    each expert ``activation(x @ w1.T, x @ w3.T) @ w2.T``."""
    y = torch.zeros_like(x)
    for e, (w1, w3, w2) in enumerate(experts):
        rows, k = (topk_ids == e).nonzero(as_tuple=True)
        if rows.numel():
            y.index_add_(0, rows, topk_weights[rows, k, None] * gated_mlp(x[rows], w1, w3, w2, activation))
    return y


def _source_experts(ckpt: Checkpoint, files: FileCache, layer: MoELayer, logical_ids: Sequence[int],
                    ) -> list[tuple[torch.Tensor, ...]]:
    """``(w1, w3, w2)`` float32 matrices of each logical expert, dequantised from the source."""
    fmt = ckpt.dims.format

    def matrix(lid: int, proj: str) -> torch.Tensor:
        read = lambda kind: files.read(ckpt.expert_entry(layer, lid, proj, kind))  # noqa: E731
        entry = ckpt.expert_entry(layer, lid, proj, "scale") if fmt.scaled else None  # FP32 values: any float dtype
        scale = (formats.fp32_block_scales(read("scale"), entry.dtype) if fmt.scale_encoding == "fp32" else
                 read("scale")) if entry is not None else None
        global_scale = read(formats.WEIGHT_GLOBAL_SCALE).view(torch.float32).reshape(()) if fmt.global_scales else None
        return formats.dequantize(fmt, read("weight"), scale, global_scale)

    return [tuple(matrix(lid, p) for p in ("w1", "w3", "w2")) for lid in logical_ids]


def _layout_experts(fmt: formats.WeightFormat, loaded: Any, slots: list[int], hidden: int, inter: int,
                    ) -> list[tuple[torch.Tensor, ...]]:
    """``(w1, w3, w2)`` of the chosen local slots, dequantised from the pre-baked kernel form."""
    pick = lambda t: None if t is None else t[slots]  # noqa: E731
    d13 = inverse.dequantize_kernel(fmt, loaded.l1.weight[slots], pick(loaded.l1.sf), hidden, True,
                                    pick(loaded.tensors.get("l1_global_scale")))
    d2 = inverse.dequantize_kernel(fmt, loaded.l2.weight[slots], pick(loaded.l2.sf), inter, False,
                                   pick(loaded.tensors.get("l2_global_scale")))
    return [(d13[e, :inter], d13[e, inter:], d2[e]) for e in range(len(slots))]


def _shared_from_layout(loaded: Any, hidden: int, shared: int) -> tuple[torch.Tensor, ...]:
    (l1w, l1sf), (l2w, l2sf) = loaded.shared
    fmt = formats.SHARED_FORMAT
    d13 = inverse.dequantize_kernel(fmt, l1w.unsqueeze(0), l1sf.unsqueeze(0), hidden, True)[0]
    d2 = inverse.dequantize_kernel(fmt, l2w.unsqueeze(0), l2sf.unsqueeze(0), shared, False)[0]
    return d13[:shared], d13[shared:], d2


def _shared_from_source(ckpt: Checkpoint, files: FileCache, layer: MoELayer) -> tuple[torch.Tensor, ...]:
    read = lambda proj, kind: files.read(ckpt.shared_entry(layer, proj, kind))  # noqa: E731
    return tuple(formats.dequantize_blocks(formats.SHARED_FORMAT, read(p, "weight"), read(p, "scale"))
                 for p in ("w1", "w3", "w2"))


def numerics_checks(ranks: Sequence[int], layers: Sequence[MoELayer], every_rank: bool = False,
                    ) -> list[tuple[int, MoELayer]]:
    """The (rank, layer) pairs ``--numerics`` runs. By default every MoE layer once, the ranks taking
    turns (each rank at least once): the layout code is the same for every rank, and ``--source``
    already compares every slot's bytes, so a check per rank and layer adds time, not coverage
    (``every_rank``: all of them)."""
    if every_rank or not ranks or not layers:
        return [(rank, layer) for rank in ranks for layer in layers]
    return [(ranks[i % len(ranks)], layers[i % len(layers)]) for i in range(max(len(ranks), len(layers)))]


def check_numerics(out: Path, manifest: Manifest, ckpt: Checkpoint, files: FileCache, report: VerifyReport,
                   checks: Sequence[tuple[int, MoELayer]], device: str, seed: int, progress: Progress,
                   tokens: int = 32, max_experts: int = NUMERICS_MAX_EXPERTS) -> None:
    """Pre-baked layout and source checkpoint must give bit-identical MoE outputs.

    Per rank and layer of ``checks`` (:func:`numerics_checks`), tokens are routed top-k over up to
    ``max_experts`` local slots (:func:`numerics_slots`: dequantised matrices are large);
    the pre-baked shared expert, where there is one, runs on the same tokens.
    """
    activation, activation_report = expert_activation(ckpt)
    scale = numerics_config(ckpt).routed_scaling_factor
    top_k = min(ckpt.top_k(), manifest.placement.experts_per_rank)
    g = torch.Generator().manual_seed(seed)
    hidden, inter = manifest.dims.hidden_size, manifest.dims.moe_intermediate_size
    worst = {"max_abs_err": 0.0, "max_rel_err": 0.0, "layers": 0, "shared_experts": 0, "tokens": tokens,
             "top_k": top_k, **activation_report, "routed_scaling_factor": scale, "device": device,
             "weight_format": manifest.dims.weight_format}
    moved = lambda ws: [tuple(w.to(device).contiguous() for w in t) for t in ws]  # noqa: E731

    def compare(where: str, what: str, y_layout: torch.Tensor, y_source: torch.Tensor) -> None:
        diff = (y_layout - y_source).abs().nan_to_num(0.0)  # NaN where both are NaN (or inf) alike
        worst["max_abs_err"] = max(worst["max_abs_err"], float(diff.max()))
        worst["max_rel_err"] = max(worst["max_rel_err"], float((diff / y_source.abs().clamp_min(1e-30)).max()))
        if not same_values(y_layout, y_source):
            report.problem(where, f"{what} from the pre-baked layout differs from the source "
                                  f"(max abs err {float(diff.max()):.3g})")

    for rank, layer in checks:
        experts = min(max_experts, manifest.placement_for(layer).experts_per_rank)
        progress.advance(experts * manifest.dims.bytes_per_expert(),
                         f"numerics: rank {rank} {layer.key}", False)
        loaded = load_layer(out, rank, layer, report)
        if loaded is None:
            continue
        slots = numerics_slots(loaded.num_local_experts, max_experts, g)
        x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).float()
        scores = torch.randn(tokens, len(slots), generator=g)
        weights, ids = scores.softmax(-1).topk(min(top_k, len(slots)), dim=-1)
        args = (x.to(device), ids.to(device), weights.to(device) * scale)
        from_source = _source_experts(ckpt, files, layer, [loaded.logical_ids[s] for s in slots])
        compare(f"rank {rank} {layer.key}", "MoE output",
                reference_moe(*args, moved(_layout_experts(manifest.dims.format, loaded, slots, hidden, inter)),
                              activation).cpu(),
                reference_moe(*args, moved(from_source), activation).cpu())
        worst["layers"] += 1
        if loaded.shared is not None:
            shared = manifest.dims.shared_intermediate_size
            layout_out, source_out = (gated_mlp(args[0], w1, w3, w2, activation).cpu()
                                      for w1, w3, w2 in moved([_shared_from_layout(loaded, hidden, shared),
                                                               _shared_from_source(ckpt, files, layer)]))
            compare(f"rank {rank} {layer.key}", "shared expert output", layout_out, source_out)
            worst["shared_experts"] += 1
    report.numerics = worst
    report.count("numerics layers", worst["layers"])
