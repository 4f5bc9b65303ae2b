"""Stand-ins for vLLM's two MegaMoE experts classes, for edge cases in the plain suite (hub
repo ids, explicit placements) where no vLLM is installed. ``tests/engines`` checks that each
stand-in has exactly the attributes, parameters, dtypes, shapes and strides of the real class
of its release, so a drift in vLLM fails there loudly."""

from __future__ import annotations

import types

import torch
from torch import nn


class _Experts(nn.Module):
    def __init__(self, prefix, num_experts, num_local_experts, experts_start_idx, hidden_size, intermediate_size,
                 num_logical_experts):
        super().__init__()
        self.prefix = prefix
        self.num_experts = num_experts
        self.num_local_experts = num_local_experts
        self.experts_start_idx = experts_start_idx
        self.experts_end_idx = experts_start_idx + num_local_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_logical_experts = num_logical_experts

    def _register(self, name: str, data: torch.Tensor) -> None:
        param = nn.Parameter(data, requires_grad=False)
        param.weight_loader = self.weight_loader
        self.register_parameter(name, param)

    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        raise NotImplementedError("stand-in: loading goes through install()")


class KernelLayoutExperts(_Experts):
    """vLLM >= 0.33 ``DeepGemmMegaMoEExperts`` (MXFP4): parameters in the kernel layout."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.weight_format = types.SimpleNamespace(name="mxfp4")
        e, h, i = self.num_local_experts, self.hidden_size, self.intermediate_size
        for name, n, k in (("w13", 2 * i, h), ("w2", h, i)):
            self._register(f"{name}_weight", torch.zeros(e, n, k // 2, dtype=torch.int8))
            self._register(f"{name}_weight_scale", torch.zeros(e, k // 128, n, dtype=torch.int32).transpose(-1, -2))
            getattr(self, f"{name}_weight_scale").quant_method = "block"

    @property
    def l1_weights(self):
        return self.w13_weight, self.w13_weight_scale

    @property
    def l2_weights(self):
        return self.w2_weight, self.w2_weight_scale


class FinalizeExperts(_Experts):
    """vLLM 0.30-0.32 ``DeepseekV4MegaMoEExperts``: uint8 loader-side parameters, finalize transforms."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        e, h, i = self.num_local_experts, self.hidden_size, self.intermediate_size
        for name, n, k in (("w13", 2 * i, h), ("w2", h, i)):
            self._register(f"{name}_weight", torch.zeros(e, n, k // 2, dtype=torch.uint8))
            self._register(f"{name}_weight_scale", torch.zeros(e, n, k // 32, dtype=torch.uint8))
            getattr(self, f"{name}_weight_scale").quant_method = "block"
        self._transformed_l1_weights = None
        self._transformed_l2_weights = None

    def _check_runtime_supported(self) -> None:
        assert self.w13_weight is not None, "the runtime check reads w13_weight's device"

    def finalize_weights(self, shared_experts=None):
        if self._transformed_l1_weights is None:
            raise RuntimeError("stand-in: the transform needs DeepGEMM on an SM100 GPU")


STAND_INS = {"kernel_layout": KernelLayoutExperts, "finalize": FinalizeExperts}


def stand_in_model(cls: type, rank: int, *, ep_size=4, redundant=4, n_layers=2, hidden=256, inter=128) -> nn.Module:
    """vLLM's module tree: ``model.layers.{L}.ffn.experts``, MTP at ``model.layers.{N}.mtp_block.ffn.experts``."""
    n_physical = 8 + redundant
    local = n_physical // ep_size
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList()
    for index in range(n_layers + 1):
        block = nn.Module()
        block.ffn = nn.Module()
        middle = "mtp_block.ffn" if index == n_layers else "ffn"
        block.ffn.experts = cls(f"model.layers.{index}.{middle}.experts", n_physical, local, rank * local, hidden,
                                inter, 8)
        root.model.layers.append(block)
    return root


def experts_of(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, _Experts)]


def kernel_tensors(module: nn.Module) -> list[torch.Tensor]:
    if isinstance(module, KernelLayoutExperts):
        return [*module.l1_weights, *module.l2_weights]
    return [*module._transformed_l1_weights, *module._transformed_l2_weights]
