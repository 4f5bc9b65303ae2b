"""vLLM 0.30-0.32: ``DeepseekV4MegaMoEExperts`` (vllm/models/deepseek_v4/nvidia/model.py).

The finalize contract: the module registers loader-side uint8 parameters in the checkpoint's
layout (``w13_weight [E, 2I, H/2]``, ``w13_weight_scale [E, 2I, H/32]``, likewise ``w2``);
``finalize_weights()`` checks the runtime (``_check_runtime_supported()``; in 0.32 it resolves
the backend through ``_ensure_backend()``, which reads ``w13_weight.device``), transforms them
into ``_transformed_l1_weights`` /
``_transformed_l2_weights``, drops the four parameters, then fuses the shared expert.
``forward`` and EPLB's ``get_expert_weights()`` read the ``_transformed_*`` tuples.

Installing: resolve the backend first (in ``check``) (while ``w13_weight`` still exists), write the rank
file's bytes into the loader-side parameters' own storage (the kernel layout has exactly their
byte count: ``H/2`` weight bytes and ``H/32`` scale bytes per row), set ``_transformed_*`` to
views of it and release the parameters, as ``finalize_weights`` does. ``finalize_weights()``
then skips the routed transform.

The fused shared expert (0.32: built with ``num_shared_experts`` when vLLM fuses, i.e. TP=1 or
sequence parallel and ``VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION`` unset, and its
backend's DeepGEMM takes shared experts): ``finalize_weights`` transforms the shared MLP's FP8
weights (``backend.transform_shared_expert_weights``), re-homes ``gate_up_proj.weight`` on the
interleaved copy and keeps ``down_proj.weight`` as the L2 weight. Installing writes the
pre-baked weights straight into those two parameters' storage (same shape and dtype), the
scales into new tensors, and sets ``_transformed_shared_l1/l2_weights``, so ``finalize_weights``
has no shared-expert work left. The checkpoint's shared weights are then not loaded; its block
scales still load into the FP8 linears, which keep them as after vLLM's own fusion. The shared
MLP lives on the module's owner (the MoE block that passes it to ``finalize_weights``), which
:meth:`FinalizeContract.bind` gives the contract. Otherwise (0.30-0.31, fusion off) the shared
expert loads and fuses (or runs) as usual.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError, version

import torch

from megamoe_convert.engines.contract import Contract, EngineModule
from megamoe_convert.engines.probe import LayoutProbe
from megamoe_convert.engines.vllm import private_hooks
from megamoe_convert.engines.vllm.experts import EP_ATTRIBUTES, expect_tensor, require
from megamoe_convert.engines.vllm.layout_probe import finalize_probe
from megamoe_convert.errors import InstallError
from megamoe_convert.serve.converted import ConvertedModel, Destinations, ExpertLayer
from megamoe_convert.source import formats
from megamoe_convert.source.layers import MoELayer

LOADER_PARAMETERS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
MARKERS = (*EP_ATTRIBUTES, "finalize_weights", "_check_runtime_supported", "_transformed_l1_weights",
           "_transformed_l2_weights", *LOADER_PARAMETERS)
#: 0.30-0.31's FlashInfer subclass (``DeepseekV4MegaMoEExpertsFI``) finalizes into its own
#: FlashInfer layout: DeepGEMM's layout is not what it runs.
FLASHINFER_MARKER = "_mega_layer"
#: What 0.32's module fuses a pre-baked shared expert with (``finalize_weights`` + its backend).
SHARED_MARKERS = ("num_shared_experts", "_transformed_shared_l1_weights", "_transformed_shared_l2_weights",
                  "_ensure_backend")


def pads_intermediate_to_512() -> bool:
    """vLLM 0.30's ``finalize_weights`` pads the intermediate size up to a multiple of 512 (and
    changes ``intermediate_size``) before transforming; later releases do not. Released
    DeepSeek-V4 models (I = 2048, 3072) are multiples of 512 already."""
    try:
        major, minor = (int(x) for x in version("vllm").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) < (0, 31)


def _as_int32_storage(param: torch.Tensor, mn: int) -> torch.Tensor:
    """A uint8 ``[E, MN, K/32]`` scale parameter's bytes as the contiguous int32 ``[E, K/128, MN]``
    storage of the kernel's MN-major scales (same byte count, reinterpreted)."""
    e, _, kb = param.shape
    return param.view(torch.int32).reshape(e, kb // 4, mn)


@dataclass(frozen=True)
class FinalizeContract(Contract):
    #: The MoE block holding the module and its shared MLP (``shared_experts``), see :meth:`bind`.
    owner: EngineModule | None = None
    name = "vLLM 0.30-0.32 DeepseekV4MegaMoEExperts (finalize_weights transforms)"

    def bind(self, owner: EngineModule | None) -> "FinalizeContract":
        """This contract for a module whose owner is ``owner`` (its shared MLP is there)."""
        return replace(self, owner=owner)

    def shared_mlp(self, module: EngineModule, converted: ConvertedModel) -> EngineModule | None:
        """The shared MLP ``finalize_weights`` would fuse, if vLLM fuses it and the conversion
        pre-baked one of the same size: FP8 ``gate_up_proj`` (2S, H) and ``down_proj`` (H, S)."""
        s = converted.manifest.dims.shared_intermediate_size
        mlp = getattr(self.owner, "shared_experts", None)
        if not s or mlp is None or require(module, SHARED_MARKERS) or module.num_shared_experts == 0 \
                or module.num_shared_experts * module.intermediate_size != s:
            return None
        h = module.hidden_size
        weight = formats.torch_dtype(formats.SHARED_FORMAT.weight_dtype)
        expected = ((getattr(mlp, "gate_up_proj", None), (2 * s, h)), (getattr(mlp, "down_proj", None), (h, s)))
        for linear, shape in expected:
            w = getattr(linear, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dtype != weight or tuple(w.shape) != shape or not w.is_contiguous():
                return None  # not what vLLM fuses either (a TP-sharded MLP, another precision)
        # vLLM's own test, as finalize_weights makes it
        return mlp if module._ensure_backend().supports_shared_experts(private_hooks.deep_gemm()) else None

    def missing(self, module: EngineModule) -> list[str]:
        gone = require(module, MARKERS)
        if hasattr(module, FLASHINFER_MARKER):
            gone.append(f"no {FLASHINFER_MARKER} (a FlashInfer MegaMoE module runs its own layout)")
        return gone

    def check(self, module: EngineModule, layer: MoELayer, converted: ConvertedModel, rank: int) -> None:
        if converted.weight_format != "mxfp4":
            raise InstallError(f"{module.prefix}: {type(module).__name__} takes MXFP4 experts only, but "
                               f"{converted.path} holds {converted.weight_format}")
        if module._transformed_l1_weights is not None or \
                getattr(module, "_transformed_shared_l1_weights", None) is not None:
            raise InstallError(f"{module.prefix}: finalize_weights() already ran; install before loading weights")
        try:  # vLLM's own capability check (0.32: resolves and caches the backend, which must
            # happen while w13_weight exists: _ensure_backend reads its device)
            module._check_runtime_supported()
        except (NotImplementedError, ValueError, RuntimeError, AssertionError) as refusal:
            raise InstallError(f"{module.prefix}: vLLM's MegaMoE backend refuses this module: {refusal}") from None
        e, h, i = module.num_local_experts, module.hidden_size, module.intermediate_size
        if i % 512 and pads_intermediate_to_512():
            raise InstallError(f"{module.prefix}: this vLLM pads intermediate_size {i} to a multiple of 512 in "
                               "finalize_weights, a layout the conversion does not hold; serve it with vLLM >= 0.31")
        for name, shape in (("w13_weight", (e, 2 * i, h // 2)), ("w13_weight_scale", (e, 2 * i, h // 32)),
                            ("w2_weight", (e, h, i // 2)), ("w2_weight_scale", (e, h, i // 32))):
            expect_tensor(module, name, torch.uint8, shape)
            if not getattr(module, name).is_contiguous():
                raise InstallError(f"{module.prefix}: {name} is not contiguous")

    def shared_kinds(self, module: EngineModule, converted: ConvertedModel) -> tuple[str, ...]:
        """The shared weights when vLLM fuses a pre-baked shared expert (:meth:`shared_mlp`);
        the block scales still load into the FP8 linears."""
        return ("weight",) if self.shared_mlp(module, converted) is not None else ()

    def layout_probe(self, module: EngineModule, converted: ConvertedModel) -> LayoutProbe:
        """The module's own ``weight_loader`` and ``finalize_weights`` (and 0.32's shared-expert
        transform, where the install pre-bakes the shared expert) on the probe's expert."""
        return finalize_probe(module, self.shared_mlp(module, converted), LOADER_PARAMETERS, self.name)

    def destinations(self, module: EngineModule, converted: ConvertedModel) -> Destinations:
        h, i = module.hidden_size, module.intermediate_size
        dests = {"l1_weight": module.w13_weight.data.view(torch.int8),
                 "l1_sf": _as_int32_storage(module.w13_weight_scale.data, 2 * i),
                 "l2_weight": module.w2_weight.data.view(torch.int8),
                 "l2_sf": _as_int32_storage(module.w2_weight_scale.data, h)}
        mlp = self.shared_mlp(module, converted)
        if mlp is not None:  # the weights into the shared MLP's own storage, the scales into new tensors
            s = converted.manifest.dims.shared_intermediate_size
            specs = formats.spec_keys(formats.shared_specs(module.prefix, h, s), module.prefix)
            device = mlp.gate_up_proj.weight.device
            dests.update({"shared_l1_weight": mlp.gate_up_proj.weight.data,
                          "shared_l2_weight": mlp.down_proj.weight.data,
                          **{key: torch.empty(specs[key].shape, dtype=torch.int32, device=device)
                             for key in ("shared_l1_sf", "shared_l2_sf")}})
        return dests

    def finish(self, module: EngineModule, layer: ExpertLayer) -> None:
        module._transformed_l1_weights = (layer.l1.weight, layer.l1.sf)
        module._transformed_l2_weights = (layer.l2.weight, layer.l2.sf)
        for name in LOADER_PARAMETERS:
            setattr(module, name, None)
        if layer.shared is not None:  # finalize_weights now finds the shared expert fused
            (l1_weight, l1_sf), (l2_weight, l2_sf) = layer.shared
            module._transformed_shared_l1_weights = (l1_weight, l1_sf)
            module._transformed_shared_l2_weights = (l2_weight, l2_sf)


CONTRACT = FinalizeContract()
