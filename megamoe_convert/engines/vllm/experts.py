"""What vLLM's two MegaMoE contracts share: module prefixes, the EP numbers, tensor checks.

vLLM names a MegaMoE module by its prefix (``model.layers.7.ffn.experts``; MTP blocks are
numbered after the decoder layers, ``model.layers.{N+i}.mtp_block.ffn.experts``; multimodal
wrappers put ``language_model.`` in front, DeepSeek-V4.1's and Kimi-K3's; Kimi-K3's MoE block is
``block_sparse_moe``) and builds it with the EP numbers of its rank; it always maps physical slot
``p`` to logical ``p % n``.
"""

from __future__ import annotations

import re
from typing import Sequence

import torch

from megamoe_convert.engines.contract import EngineModule
from megamoe_convert.errors import InstallError, PlacementError
from megamoe_convert.layout.placement import Placement, default_problem
from megamoe_convert.output.shards import rank_shard_specs
from megamoe_convert.serve.converted import ConvertedModel
from megamoe_convert.source import formats
from megamoe_convert.source.layers import MoELayer

#: ``model.layers.7.ffn.experts``, ``model.layers.43.mtp_block.ffn.experts``, ``model.mtp.0.ffn.experts``,
#: ``language_model.model.layers.7.ffn.experts``, ``language_model.model.layers.7.block_sparse_moe.experts``.
VLLM_PREFIX = re.compile(r"^(?:language_model\.)?(?:model\.)?(?P<kind>layers|mtp)\.(?P<index>\d+)\.(?:mtp_block\.)?"
                         r"(?:ffn|block_sparse_moe)\.experts$")
#: What every vLLM MegaMoE experts module has, whatever its contract.
EP_ATTRIBUTES = ("prefix", "experts_start_idx", "num_local_experts", "hidden_size", "intermediate_size")


def layer_key(prefix: str, num_hidden_layers: int) -> str:
    """vLLM module prefix -> checkpoint layer key (``layers.7`` / ``mtp.0``)."""
    m = VLLM_PREFIX.match(prefix)
    if m is None:
        raise InstallError(f"{prefix}: not a MegaMoE experts prefix (expected model.layers.N.ffn.experts)")
    index = int(m["index"])
    if m["kind"] == "mtp":
        return f"mtp.{index}"
    return f"layers.{index}" if index < num_hidden_layers else f"mtp.{index - num_hidden_layers}"


def looks_like_megamoe_experts(module: EngineModule) -> bool:
    """A candidate for some contract: MegaMoE by name, or carrying vLLM's EP attributes."""
    name = type(module).__name__
    return ("MegaMoE" in name and name.endswith("Experts")) or all(hasattr(module, a) for a in EP_ATTRIBUTES)


def check_ep_numbers(module: EngineModule, layer: MoELayer, converted: ConvertedModel, rank: int) -> None:
    """Every number the module was built with must be the one the layer's shards were built for
    (DeepSeek-V4.1's DSpark MTP layers: their own expert count)."""
    placement, dims = converted.placement_for(layer), converted.manifest.dims
    expected = {
        "experts_start_idx": placement.experts_start(rank),
        "num_local_experts": placement.experts_per_rank,
        "num_experts": placement.n_physical,
        "num_logical_experts": placement.n_logical,
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.moe_intermediate_size,
    }
    for attribute, want in expected.items():
        got = getattr(module, attribute, want)
        if got != want:
            raise InstallError(f"{module.prefix}: {attribute} is {got} in the model but {want} in {converted.path} "
                               f"(rank {rank}, ep_size {placement.ep_size})")
    if not placement.is_default():
        raise InstallError(f"{module.prefix}: the conversion uses an explicit expert placement, but "
                           f"{type(module).__name__} maps physical slot p to logical p % num_logical_experts; "
                           "convert with the default placement to serve it with vLLM")


def module_placement(module: EngineModule, n_logical: int, where: str = "") -> Placement:
    """The placement vLLM built a module with over ``n_logical`` logical experts: its ``num_experts``
    physical slots (EPLB's redundant ones included), ``num_local_experts`` per rank, slot ``p`` holding
    ``p % n_logical`` (``_map_global_expert_id``; MTP layers alike, with their own numbers). ``where``
    leads a refusal."""
    n_physical, local = module.num_experts, module.num_local_experts
    if not isinstance(local, int) or local <= 0 or n_physical % local:
        raise PlacementError(f"{where}num_experts {n_physical} is not a whole number of ranks of {local} "
                             "local experts")
    ep_size, redundant = n_physical // local, n_physical - n_logical
    if (problem := default_problem(n_logical, ep_size, redundant)) is not None:
        raise PlacementError(f"{where}{problem}")
    return Placement.default(n_logical, ep_size, redundant)


def current_ep_rank() -> int:
    """This process's rank in vLLM's expert-parallel group."""
    try:
        from vllm.distributed import get_ep_group
    except ImportError as e:
        raise InstallError("rank=None needs vLLM's EP group, but vllm is not importable; pass rank=") from e
    return int(get_ep_group().rank_in_group)


def require(module: EngineModule, names: Sequence[str]) -> list[str]:
    """The attributes of ``names`` the module lacks."""
    return [n for n in names if not hasattr(module, n)]


def expect_tensor(module: EngineModule, name: str, dtype: torch.dtype, shape: tuple[int, ...],
                  stride: tuple[int, ...] | None = None) -> None:
    """A parameter the bytes will go into must be exactly what the conversion wrote."""
    t = getattr(module, name, None)
    if not isinstance(t, torch.Tensor):
        raise InstallError(f"{module.prefix}: {name} is {type(t).__name__}, expected a {dtype} tensor "
                           "(already finalized or released?)")
    if t.dtype != dtype or tuple(t.shape) != shape or (stride is not None and tuple(t.stride()) != stride):
        raise InstallError(f"{module.prefix}: {name} is {t.dtype}{list(t.shape)} with strides {list(t.stride())}, "
                           f"expected {dtype}{list(shape)}" + (f" with strides {list(stride)}" if stride else ""))


def expect_kernel_tensors(module: EngineModule, parameters: dict[str, str], layer: MoELayer,
                          converted: ConvertedModel) -> None:
    """Each ``{rank-file key: parameter}`` must be exactly the tensor the conversion wrote for it:
    its dtype and shape, contiguous, or for scales (``*_sf``) the MN-major view of a contiguous array."""
    dims = converted.manifest.dims
    specs = formats.spec_keys(rank_shard_specs(layer, converted.placement_for(layer).experts_per_rank, dims),
                              layer.prefix)
    for key, name in parameters.items():
        shape = specs[key].shape
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        stride = tuple(strides)
        if key.endswith("_sf"):  # storage [..., words, MN] -> kernel view [..., MN, words]
            shape, stride = (*shape[:-2], shape[-1], shape[-2]), (*stride[:-2], stride[-1], stride[-2])
        expect_tensor(module, name, formats.torch_dtype(specs[key].dtype), tuple(shape), tuple(stride))
