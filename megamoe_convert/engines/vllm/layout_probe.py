"""vLLM's own loading code, run on the layout probe's synthetic expert (``engines/probe.py``).

- >= 0.33 (:func:`kernel_layout_probe`): the parameters are the kernel layout and the module's
  ``weight_loader`` writes each checkpoint shard straight into it; the probe calls each parameter's
  ``weight_loader`` exactly as the models' ``load_weights`` do after their name mapping (``w1`` /
  ``w3`` / ``w2`` shards of expert 0, UE8M0 scales viewed as bytes first, NVFP4's global scales
  too), and ``load_shared_expert_weight`` for a fused shared expert.
- 0.30-0.32 (:func:`finalize_probe`): the module's ``weight_loader`` fills the loader-side
  parameters, then its own ``finalize_weights`` transforms them (DeepGEMM's
  ``transform_sf_into_required_layout`` and ``transform_weights_for_mega_moe``, through vLLM's
  ``_import_deep_gemm``); a fused shared expert (0.32) goes through the backend's
  ``transform_shared_expert_weights`` on a scratch MLP of the real one's attributes.

Each runs on a scratch twin with one local expert slot: nothing of the real module is written.
Every model family vLLM serves through these modules maps names before ``weight_loader``; the
bytes are laid out by the module, which is what is probed.
"""

from __future__ import annotations

import functools
import types
from typing import Mapping

import torch

from megamoe_convert.engines import probe
from megamoe_convert.engines.contract import EngineModule
from megamoe_convert.layout.identity import ProbeInput, Tensors

#: The checkpoint tensor kind -> the suffix of the parameter it loads into (``w13_`` / ``w2_`` before it).
PARAMETER_KIND = {"weight": "weight", "scale": "weight_scale", "weight_scale_2": "weight_scale_2",
                  "input_scale": "input_scale"}
#: One local expert slot: ``_map_global_expert_id(0)`` is ``[0]``.
ONE_SLOT = {"num_local_experts": 1, "experts_start_idx": 0, "experts_end_idx": 1}


@functools.lru_cache(maxsize=1)
def engine_label() -> str:
    """``vLLM 0.33.0 (DeepGEMM 2.8.1)``: the release and the DeepGEMM it imports (an installed
    ``deep_gemm`` first, then the copy vLLM bundles, as ``vllm.utils.deep_gemm`` does)."""
    deep_gemm = probe.module_version("deep_gemm") or probe.module_version("vllm.third_party.deep_gemm")
    version = probe.package_version("vllm") or probe.module_version("vllm") or "(version unknown)"
    return f"vLLM {version} (DeepGEMM {deep_gemm or 'absent'})"


def _as_loaded(t: torch.Tensor) -> torch.Tensor:
    """What the models' ``load_weights`` hand ``weight_loader``: E8M0 scales viewed as bytes."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t


def _parameter(proj: str, kind: str) -> str:
    return ("w2_" if proj == "w2" else "w13_") + PARAMETER_KIND[kind]


def kernel_layout_probe(module: EngineModule, parameters: Mapping[str, str], contract: str) -> probe.LayoutProbe:
    """The >= 0.33 probe: ``parameters`` maps rank-file keys to the module's parameters."""

    def run(inp: ProbeInput, shapes: Mapping[str, tuple[int, ...]]) -> Tensors:
        params = {parameters[k]: probe.like(getattr(module, parameters[k]), shape)
                  for k, shape in shapes.items() if k in parameters}
        twin: EngineModule = probe.scratch_twin(module, params, hidden_size=inp.hidden, intermediate_size=inp.inter,
                                                **ONE_SLOT)
        for (proj, kind), tensor in inp.routed.items():
            name = _parameter(proj, kind)
            param = twin._parameters[name]
            if not param.weight_loader(param, _as_loaded(tensor), f"{module.prefix}.{name}", shard_id=proj,
                                       expert_id=0, return_success=True):
                raise RuntimeError(f"its weight_loader did not take {name} ({proj}) of expert 0")
        layer = module.prefix.rpartition(".experts")[0]
        for (proj, kind), tensor in inp.shared.items():
            suffix = "weight" if kind == "weight" else "weight_scale"
            twin.load_shared_expert_weight(f"{layer}.shared_experts.{proj}.{suffix}", _as_loaded(tensor))
        out = {k: getattr(twin, parameters[k]) for k in shapes if k in parameters}
        if "l2_input_scale_all" in shapes:  # the record the kernel takes the maximum of
            out["l2_input_scale_all"] = twin._w2_input_scales[:1]
        return out

    return probe.LayoutProbe(engine_label(), module.prefix, run, contract)


def finalize_probe(module: EngineModule, shared_mlp: EngineModule | None, loader_parameters: tuple[str, ...],
                   contract: str) -> probe.LayoutProbe:
    """The 0.30-0.32 probe: ``loader_parameters`` are the module's loader-side parameters
    (``w13_weight``, ``w13_weight_scale``, ``w2_weight``, ``w2_weight_scale``); ``shared_mlp`` the
    real shared MLP when the install pre-bakes the fused shared expert."""

    def run(inp: ProbeInput, shapes: Mapping[str, tuple[int, ...]]) -> Tensors:
        loaded = {_parameter(proj, kind) for proj, kind in inp.routed}
        params = {}
        for name in loader_parameters:
            projs, kind = (("w2",) if name.startswith("w2_") else ("w1", "w3")), name.partition("_")[2]
            rows = inp.stacked(projs, "weight" if kind == "weight" else "scale")
            params[name] = probe.like(getattr(module, name), tuple(rows.shape))
        if not loaded <= set(params):
            raise RuntimeError(f"no loader-side parameter for {sorted(loaded - set(params))}")
        twin: EngineModule = probe.scratch_twin(module, params, hidden_size=inp.hidden, intermediate_size=inp.inter,
                                  _transformed_l1_weights=None, _transformed_l2_weights=None, **ONE_SLOT)
        for (proj, kind), tensor in inp.routed.items():
            name = _parameter(proj, kind)
            param = twin._parameters[name]
            param.weight_loader(param, _as_loaded(tensor), f"{module.prefix}.{name}", shard_id=proj, expert_id=0)
        twin.finalize_weights()  # the routed transform only: no shared MLP given
        (l1_weight, l1_sf), (l2_weight, l2_sf) = twin._transformed_l1_weights, twin._transformed_l2_weights
        out = {"l1_weight": l1_weight, "l1_sf": l1_sf, "l2_weight": l2_weight, "l2_sf": l2_sf}
        if inp.shared:
            out.update(_finalize_shared(twin, shared_mlp, inp))
        return out

    return probe.LayoutProbe(engine_label(), module.prefix, run, contract)


def _finalize_shared(twin: EngineModule, shared_mlp: EngineModule | None, inp: ProbeInput) -> Tensors:
    """0.32's fused shared expert: the backend's own transform of a scratch MLP holding the probe's
    FP8 weights and 128x128 block scales under the real linears' attribute names."""
    if shared_mlp is None:
        raise RuntimeError("no shared MLP to fuse")
    scratch = types.SimpleNamespace()
    for linear, projs in (("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",))):
        real = getattr(shared_mlp, linear)
        device = real.weight.device
        part = types.SimpleNamespace(weight=torch.cat([inp.shared[p, "weight"] for p in projs]).to(device),
                                     weight_block_size=getattr(real, "weight_block_size", None))
        scale = "weight_scale" if hasattr(real, "weight_scale") else "weight_scale_inv"
        setattr(part, scale, torch.cat([inp.shared[p, "scale"] for p in projs]).to(device))
        setattr(scratch, linear, part)
    result = twin._ensure_backend().transform_shared_expert_weights(
        shared_experts=scratch, num_shared_experts=inp.shared_inter // inp.inter, hidden_size=inp.hidden,
        intermediate_size=inp.inter, prefix=twin.prefix)
    if result is None:
        raise RuntimeError("its shared-expert transform declined the probe's shared expert")
    (l1_weight, l1_sf), (l2_weight, l2_sf) = result
    return {"shared_l1_weight": l1_weight, "shared_l1_sf": l1_sf, "shared_l2_weight": l2_weight,
            "shared_l2_sf": l2_sf}
