"""The MegaMoE weight formats, as one table: everything that differs between them lives here.

vLLM's ``DeepGemmMegaMoEExperts`` knows four routed-expert formats (``MEGA_MOE_WEIGHT_FORMATS``).
They share one kernel layout (``layout.py``): weight rows are bytes whose gate/up rows are
interleaved; block-scale bytes are packed four to an int32 along K, made MN-major, interleaved
and UTCCP-transposed. What differs is data, and this module holds it:

========  ==================  ===============  ================  ==============================
format    weight              values / elem    block scale       extra per-expert tensors
========  ==================  ===============  ================  ==============================
mxfp4     int8 (packed e2m1)  2                1x32 UE8M0        -
mxfp8     float8_e4m3fn       1                1x32 UE8M0        -
nvfp4     int8 (packed e2m1)  2                1x16 E4M3         FP32 L1/L2 global, L2 input
bf16      bfloat16            1                none              -
fp8_block float8_e4m3fn       1                128x128 FP32      - (Hopper: SGLang's SM90 layout)
========  ==================  ===============  ================  ==============================

``fp8_block`` is another kernel layout (``kernel = "sm90"``): SGLang's
``build_sm90_mega_moe_experts_weights`` for DeepGEMM's ``fp8_mega_moe`` interleaves the L1 weight's
gate/up rows 8 by 8 and leaves the weights' FP32 128x128 block scales (``weight_scale_inv``) as the
checkpoint stores them: no packing, no MN-major, no UTCCP (``docs/megamoe-layout.md``, "SM90").

A fused shared expert is always MXFP8 here (the one shared precision DeepSeek-V4's FP8 block
checkpoints fit): 128x128 block scales expanded to the kernel's 1x32.

Nothing outside this module knows a format's byte widths, scale group or extra tensors:
checkpoint checks, conversion, loading, verification and the engine contracts ask it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from megamoe_convert import jsonio
from megamoe_convert.errors import FormatError
from megamoe_convert.source.safetensors_io import DTYPE_BITS, TORCH_DTYPES, TensorSpec

#: Scale bytes packed into one int32 word along K (``_pack_scale``).
SCALES_PER_WORD = 4


@dataclass(frozen=True)
class WeightFormat:
    """One routed-expert precision: how a ``[N, K]`` weight and its scales are stored."""

    name: str  # vLLM's MEGA_MOE_WEIGHT_FORMATS key
    weight_dtype: str  # safetensors dtype of the kernel weight (rank files)
    checkpoint_weight_dtypes: tuple[str, ...]  # what a checkpoint may store the weight as
    values_per_element: int = 1  # 2: two FP4 values per byte along K
    scale_group_k: int | None = None  # K values per block scale; None: unscaled
    scale_dtypes: tuple[str, ...] = ()  # checkpoint scale dtypes (first: what synth writes)
    global_scales: bool = False  # NVFP4's per-expert FP32 scales
    element: str = "e2m1"  # what one weight value is: "e2m1" (packed FP4), "e4m3" or "bf16"
    scale_encoding: str | None = "ue8m0"  # what one block-scale byte is: "ue8m0", "e4m3" (None: unscaled)
    fuses_fp8_shared: bool = True  # the kernel can run an MXFP8 shared expert beside these experts
    scale_block_n: int = 1  # rows one block scale covers (128: FP8 128x128 blocks)
    kernel: str = "sm100"  # the kernel layout: "sm100" (layout.py's MegaMoE) or "sm90" (SGLang's FP8)

    @property
    def scaled(self) -> bool:
        return self.scale_group_k is not None

    def weight_row_bytes(self, k: int) -> int:
        """Bytes of one weight row of ``k`` values (the kernel and the checkpoint agree)."""
        return k // self.values_per_element * DTYPE_BITS[self.weight_dtype] // 8

    def scale_row_bytes(self, k: int) -> int:
        """Block-scale bytes of one row of ``k`` values (one byte per group)."""
        assert self.scale_group_k is not None
        return k // self.scale_group_k

    def scale_words(self, k: int) -> int:
        """int32 words of one packed scale row (``_pack_scale``: four bytes per word)."""
        return self.scale_row_bytes(k) // SCALES_PER_WORD

    @property
    def scale_bytes(self) -> int:
        """Bytes of one block scale (4: an FP32 128x128 block scale)."""
        return 4 if self.scale_encoding == "fp32" else 1

    def scale_shape(self, n: int, k: int) -> tuple[int, int]:
        """``[rows, blocks]`` of the block scales of an ``[n, k]`` weight."""
        assert self.scale_group_k is not None
        return n // self.scale_block_n, k // self.scale_group_k


MXFP4 = WeightFormat("mxfp4", "I8", ("I8", "U8", "F4"), values_per_element=2, scale_group_k=32,
                     scale_dtypes=("F8_E8M0", "U8"))
MXFP8 = WeightFormat("mxfp8", "F8_E4M3", ("F8_E4M3",), scale_group_k=32, scale_dtypes=("F8_E8M0", "U8"),
                     element="e4m3")
NVFP4 = WeightFormat("nvfp4", "I8", ("U8", "I8", "F4"), values_per_element=2, scale_group_k=16,
                     scale_dtypes=("F8_E4M3",), global_scales=True, scale_encoding="e4m3")
BF16 = WeightFormat("bf16", "BF16", ("BF16",), fuses_fp8_shared=False, element="bf16", scale_encoding=None)
FP8_BLOCK = WeightFormat("fp8_block", "F8_E4M3", ("F8_E4M3",), scale_group_k=128, scale_dtypes=("F32", "BF16", "F16"),
                         element="e4m3", scale_encoding="fp32", fuses_fp8_shared=False, scale_block_n=128,
                         kernel="sm90")

FORMATS: dict[str, WeightFormat] = {f.name: f for f in (MXFP4, MXFP8, NVFP4, BF16, FP8_BLOCK)}
#: The format of a fused shared expert (``shared_l1`` / ``shared_l2``).
SHARED_FORMAT = MXFP8
#: ``config.json`` ``expert_dtype`` values whose experts MegaMoE takes: DeepSeek-V4's ``fp4`` names
#: the checkpoint's tensor naming (``.scale`` -> ``.weight_scale``); the format itself is read off
#: the expert tensors (:func:`identify`).
EXPERT_DTYPES = ("fp4",)


def by_name(name: str, where: object = "weight_format") -> WeightFormat:
    """The format called ``name``; anything else is refused by name."""
    fmt = FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise FormatError(f"{where}: unknown MegaMoE weight format {name!r} (known: {', '.join(FORMATS)})")
    return fmt


def check_expert_dtype(value: Any, where: object) -> None:
    """``config.json``'s ``expert_dtype`` (default ``fp4``) must be one whose experts MegaMoE takes."""
    if value not in EXPERT_DTYPES:
        hint = " (FP8 block-scaled experts, e.g. a -Base checkpoint)" if value == "fp8" else ""
        raise FormatError(f"{where}: expert_dtype is {jsonio.short(value)}{hint}; MegaMoE conversion supports "
                          f"{', '.join(repr(k) for k in EXPERT_DTYPES)}")


def quantization_config(fmt: WeightFormat) -> dict[str, Any] | None:
    """The ``quantization_config`` of a checkpoint of ``fmt`` experts, as the FP8 releases ship it
    (DeepSeek-V3, Qwen3-MoE-FP8) and SGLang's kernel runs; ``None``: the format has none of its own."""
    if fmt.scale_encoding != "fp32":
        return None
    return {"quant_method": "fp8", "fmt": fmt.element, "weight_block_size": [fmt.scale_block_n, fmt.scale_group_k],
            "activation_scheme": "dynamic"}


#: Keys of :func:`quantization_config` a checkpoint may leave out (their absence means that value).
QUANTIZATION_DEFAULTED = ("fmt", "activation_scheme")


def check_quantization_config(fmt: WeightFormat, section: Any, where: object) -> None:
    """A checkpoint's ``quantization_config`` must say what its experts are (:func:`quantization_config`):
    an engine quantizes by the block size and element it names, so another one is refused by key."""
    want = quantization_config(fmt)
    if want is None:
        return
    if not isinstance(section, dict):
        found = "missing" if section is None else jsonio.short(section)
        raise FormatError(f"{where}: quantization_config is {found}; {fmt.name} experts need {json.dumps(want)}")
    for key, value in want.items():
        if key not in section and key in QUANTIZATION_DEFAULTED:
            continue
        if json.dumps(section.get(key)) != json.dumps(value):
            found = jsonio.short(section[key]) if key in section else "missing"
            raise FormatError(f"{where}: quantization_config.{key} is {found}, expected {json.dumps(value)} "
                              f"(the checkpoint's experts are {fmt.name}: {fmt.element} with "
                              f"{fmt.scale_block_n}x{fmt.scale_group_k} block scales)")


def identify(weight_dtype: str, scale_dtype: str | None, where: object) -> WeightFormat:
    """The format of experts whose weights are ``weight_dtype`` with ``scale_dtype`` block scales
    (``None``: unscaled); anything else is refused naming what was found."""
    for fmt in FORMATS.values():
        if weight_dtype in fmt.checkpoint_weight_dtypes and (
                scale_dtype in fmt.scale_dtypes if fmt.scaled else scale_dtype is None):
            return fmt
    known = "; ".join(f"{f.name}: {'/'.join(f.checkpoint_weight_dtypes)} weights"
                      + (f" with {'/'.join(f.scale_dtypes)} scales" if f.scaled else " unscaled")
                      for f in FORMATS.values())
    found = f"{weight_dtype} weights " + (f"with {scale_dtype} scales" if scale_dtype else "without scales")
    raise FormatError(f"{where}: {found} are no MegaMoE weight format ({known})")


# --------------------------------------------------------------------------------------
# Checkpoint side: what one routed expert's tensors must be
# --------------------------------------------------------------------------------------

#: ``(projection, kind)`` of NVFP4's FP32 scalars: the L1 global scale is given for w1 and w3
#: (one value per expert: they must be equal), the L2 input scale for w2 only.
GLOBAL_SCALE_TENSORS = (("w1", "weight_scale_2"), ("w3", "weight_scale_2"), ("w2", "weight_scale_2"),
                        ("w2", "input_scale"))
#: The kind of each projection's weight global scale (the factor its dequantised values carry).
WEIGHT_GLOBAL_SCALE = "weight_scale_2"
#: e2m1 code -> value (bit 3 the sign); element ``2k`` of a packed row is the low nibble of byte ``k``.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: torch dtype of a one-element-per-value weight.
ELEMENT_DTYPES = {"e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16}


def expert_matrix_shapes(hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    """``[N, K]`` of each projection of one expert: w1/w3 ``[I, H]`` (gate/up), w2 ``[H, I]``."""
    return {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)}


def checkpoint_byte_shapes(fmt: WeightFormat, hidden: int, inter: int) -> dict[tuple[str, str], tuple[int, ...]]:
    """Bytes of each ``(projection, kind)`` tensor of one expert, as ``(rows, row bytes)``;
    NVFP4's global scales are one FP32 each (``(4,)``)."""
    shapes: dict[tuple[str, str], tuple[int, ...]] = {}
    for proj, (n, k) in expert_matrix_shapes(hidden, inter).items():
        shapes[proj, "weight"] = (n, fmt.weight_row_bytes(k))
        if fmt.scaled:
            rows, blocks = fmt.scale_shape(n, k)
            shapes[proj, "scale"] = (rows, blocks * fmt.scale_bytes)
    if fmt.global_scales:
        shapes.update({key: (4,) for key in GLOBAL_SCALE_TENSORS})
    return shapes


def checkpoint_dtypes(fmt: WeightFormat, kind: str) -> tuple[str, ...]:
    """The safetensors dtypes a checkpoint may store an expert tensor of ``kind`` as."""
    if kind == "weight":
        return fmt.checkpoint_weight_dtypes
    return fmt.scale_dtypes if kind == "scale" else ("F32",)


# --------------------------------------------------------------------------------------
# Rank files: the tensors of one rank's shard of one layer
# --------------------------------------------------------------------------------------

#: Rank-file tensor of each key, after the layer prefix (``layers.7.ffn.experts.l1.weight``).
#: ``*.sf`` hold MN-major scales' storage ``[E, K/(4*group), MN]`` (kernel view: ``.transpose(-1, -2)``);
#: an SM90 format's hold its FP32 block scales ``[E, N/128, K/128]`` as they are (``layout.scales.sf_kernel_view``).
FILE_NAMES = {
    "l1_weight": "l1.weight", "l1_sf": "l1.sf", "l2_weight": "l2.weight", "l2_sf": "l2.sf",
    # NVFP4: per local slot, and the L2 input scale of every logical expert (the kernel takes their max)
    "l1_global_scale": "l1.global_scale", "l2_global_scale": "l2.global_scale",
    "l2_input_scale": "l2.input_scale", "l2_input_scale_all": "l2.input_scale_all",
    "logical_ids": "logical_ids",
    # the fused shared expert, laid out like one routed expert of SHARED_FORMAT
    "shared_l1_weight": "shared_l1.weight", "shared_l1_sf": "shared_l1.sf",
    "shared_l2_weight": "shared_l2.weight", "shared_l2_sf": "shared_l2.sf",
}
GLOBAL_SCALE_KEYS = ("l1_global_scale", "l2_global_scale", "l2_input_scale")
#: The routed GEMM operands (the rest of a rank file is "extras": ``rank_extras.extra_chunks``).
ROUTED_KEYS = ("l1_weight", "l1_sf", "l2_weight", "l2_sf")
SHARED_KEYS = ("shared_l1_weight", "shared_l1_sf", "shared_l2_weight", "shared_l2_sf")



def tensor_names(prefix: str) -> dict[str, str]:
    """Every rank-file tensor name a layer can have, by key."""
    return {key: f"{prefix}.{name}" for key, name in FILE_NAMES.items()}


def _gemm_specs(fmt: WeightFormat, names: dict[str, str], key: str, outer: tuple[int, ...], mn: int,
                k: int) -> Iterator[TensorSpec]:
    """Weight and (if scaled) scale storage of one GEMM operand with ``outer`` leading dims."""
    count = 1
    for d in outer:
        count *= d
    row = fmt.weight_row_bytes(k)
    elements = row * 8 // DTYPE_BITS[fmt.weight_dtype]
    yield TensorSpec(names[f"{key}_weight"], fmt.weight_dtype, (*outer, mn, elements), count * mn * row)
    if fmt.scaled and fmt.kernel == "sm90":  # the FP32 block scales as SGLang holds them
        rows, blocks = fmt.scale_shape(mn, k)
        yield TensorSpec(names[f"{key}_sf"], "F32", (*outer, rows, blocks), count * rows * blocks * 4)
    elif fmt.scaled:
        words = fmt.scale_words(k)
        yield TensorSpec(names[f"{key}_sf"], "I32", (*outer, words, mn), count * words * mn * 4)


def rank_tensor_specs(fmt: WeightFormat, prefix: str, experts: int, hidden: int, inter: int, n_logical: int,
                      shared_inter: int = 0) -> list[TensorSpec]:
    """The tensors of one rank shard, in file order: routed L1, L2, global scales (NVFP4),
    logical ids, then the shared expert (``shared_inter > 0``)."""
    names = tensor_names(prefix)
    specs = [*_gemm_specs(fmt, names, "l1", (experts,), 2 * inter, hidden),
             *_gemm_specs(fmt, names, "l2", (experts,), hidden, inter)]
    if fmt.global_scales:
        specs += [TensorSpec(names[key], "F32", (experts,), experts * 4) for key in GLOBAL_SCALE_KEYS]
        specs.append(TensorSpec(names["l2_input_scale_all"], "F32", (n_logical,), n_logical * 4))
    specs.append(TensorSpec(names["logical_ids"], "I32", (experts,), experts * 4))
    return specs + (shared_specs(prefix, hidden, shared_inter) if shared_inter else [])


#: The rank-file tensors with one block per expert slot, expert-major (``E`` outermost, scales' storage
#: too): a rank's is its slots' blocks of a store's, in slot order. The others (``l2_input_scale_all``,
#: ``shared_*``) are per layer: the same in every rank's file.
PER_SLOT_KEYS = ("l1_weight", "l1_sf", "l2_weight", "l2_sf", *GLOBAL_SCALE_KEYS, "logical_ids")


def shared_specs(prefix: str, hidden: int, shared_inter: int) -> list[TensorSpec]:
    """The fused shared expert's tensors, laid out like one routed expert of :data:`SHARED_FORMAT`."""
    names = tensor_names(prefix)
    return [*_gemm_specs(SHARED_FORMAT, names, "shared_l1", (), 2 * shared_inter, hidden),
            *_gemm_specs(SHARED_FORMAT, names, "shared_l2", (), hidden, shared_inter)]


def spec_keys(specs: list[TensorSpec], prefix: str) -> dict[str, TensorSpec]:
    """``{key: spec}`` of a layer's specs (inverse of :func:`tensor_names`)."""
    by_name = {name: key for key, name in tensor_names(prefix).items()}
    return {by_name[s.name]: s for s in specs}


# --------------------------------------------------------------------------------------
# The fused shared expert: which checkpoint shared MLPs can be pre-baked
# --------------------------------------------------------------------------------------

#: What a shared-expert scale must be to expand into SHARED_FORMAT's 1x32 UE8M0 groups.
SHARED_SCALE_DTYPES = ("F8_E8M0", "U8")


def shared_expert_problem(weight_dtype: str, weight_shape: tuple[int, ...], scale_dtype: str,
                          scale_shape: tuple[int, ...], n: int, k: int) -> str | None:
    """Why a shared-expert ``[n, k]`` linear cannot run inside the MegaMoE launch, or ``None``.

    The same test vLLM makes (``_matches_weight_spec``): an FP8 e4m3 weight whose UE8M0 block
    scales tile it in whole multiples of the 1x32 group.
    """
    group = SHARED_FORMAT.scale_group_k
    assert group is not None
    if weight_dtype != SHARED_FORMAT.weight_dtype or tuple(weight_shape) != (n, k):
        return f"weight is {weight_dtype}{list(weight_shape)}, expected {SHARED_FORMAT.weight_dtype}{[n, k]}"
    if scale_dtype not in SHARED_SCALE_DTYPES or len(scale_shape) != 2:
        return (f"scale is {scale_dtype}{list(scale_shape)}, "
                f"expected UE8M0 block scales ({', '.join(SHARED_SCALE_DTYPES)})")
    rows, cols = scale_shape
    if not rows or not cols or n % rows or k % cols or (k // cols) % group:
        return f"scale {list(scale_shape)} does not tile [{n}, {k}] in multiples of 1x{group}"
    return None


def manifest_fields(dims: dict[str, Any], fields: jsonio.Fields, max_dim: int) -> dict[str, Any]:
    """``weight_format`` and ``shared_intermediate_size`` of a manifest's ``dims``, read through
    the manifest's validating ``fields``."""
    name = fields.str(dims, "weight_format", name="dims.weight_format")
    if name not in FORMATS:
        raise fields.fail(f"dims.weight_format: unknown MegaMoE weight format {jsonio.short(name)} "
                          f"(known: {', '.join(FORMATS)})")
    shared = fields.int(dims, "shared_intermediate_size", hi=max_dim, name="dims.shared_intermediate_size")
    return {"weight_format": name, "shared_intermediate_size": shared}


def torch_dtype(dtype: str) -> torch.dtype:
    """torch's dtype of a safetensors dtype (``safetensors_io.TORCH_DTYPES``)."""
    return TORCH_DTYPES[dtype]


# --------------------------------------------------------------------------------------
# Values: what the bytes mean (``verify --numerics`` dequantises both forms with these)
# --------------------------------------------------------------------------------------

def fp32_block_scales(raw: torch.Tensor, dtype: str) -> torch.Tensor:
    """A checkpoint's FP32-encoded block scales ``[rows, bytes]`` stored as ``dtype`` (``F32``, or the
    ``BF16`` / ``F16`` some FP8 releases ship) -> float32 ``[rows, blocks]``: widened exactly, as
    SGLang's ``weight_loader`` copies them into its FP32 ``weight_scale_inv``."""
    return raw.contiguous().view(torch.uint8).view(torch_dtype(dtype)).float()


def decode_elements(fmt: WeightFormat, raw: torch.Tensor) -> torch.Tensor:
    """Weight bytes ``uint8 [..., N, row bytes]`` -> float32 values ``[..., N, K]``: FP4 e2m1
    codes two to a byte (element ``2k`` the low nibble), or one e4m3 / bf16 value per element."""
    raw = raw.contiguous().view(torch.uint8)
    if fmt.element == "e2m1":
        codes = torch.stack([raw & 0x0F, raw >> 4], dim=-1).reshape(*raw.shape[:-1], -1)
        return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=raw.device)[codes.long()]
    return raw.view(ELEMENT_DTYPES[fmt.element]).float()


def decode_scales(fmt: WeightFormat, raw: torch.Tensor) -> torch.Tensor:
    """Block-scale bytes ``uint8 [..., N, K/group]`` -> float32: UE8M0 is ``2 ** (b - 127)``
    (the float32 whose exponent bits are ``b``), E4M3 its FP8 value."""
    raw = raw.contiguous().view(torch.uint8)
    if fmt.scale_encoding == "ue8m0":
        return (raw.to(torch.int32) << 23).view(torch.float32)
    if fmt.scale_encoding == "fp32":
        return raw.view(torch.float32)
    return raw.view(torch.float8_e4m3fn).float()


def dequantize(fmt: WeightFormat, weight: torch.Tensor, scale: torch.Tensor | None = None,
               global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., N, K]`` float32 values of a weight in checkpoint row order: its elements times
    its block scale (each covering ``scale_group_k`` values along K) times, for NVFP4, the
    per-expert FP32 ``global_scale`` (``[...]``, one per leading index)."""
    values = decode_elements(fmt, weight)
    if fmt.scaled:
        assert scale is not None and fmt.scale_group_k is not None
        scales = decode_scales(fmt, scale).repeat_interleave(fmt.scale_group_k, dim=-1)
        values = values * (scales.repeat_interleave(fmt.scale_block_n, dim=-2) if fmt.scale_block_n > 1 else scales)
    if fmt.global_scales:
        assert global_scale is not None
        values = values * global_scale.float().reshape(*global_scale.shape, 1, 1)
    return values



def dequantize_blocks(fmt: WeightFormat, weight: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """A checkpoint FP8 linear's ``[N, K]`` values from its coarse block scales ``[N/br, K/bc]``
    (DeepSeek-V4's 128x128): each scale applies to every value of its block. Independent of
    the conversion's expansion to 1x32 groups, which the numerics check compares against."""
    values = decode_elements(fmt, weight)
    scale = decode_scales(fmt, block_scale)
    rows, cols = values.shape[-2] // scale.shape[-2], values.shape[-1] // scale.shape[-1]
    return values * scale.repeat_interleave(rows, dim=-2).repeat_interleave(cols, dim=-1)
