"""The layout identity a conversion records: what its experts' bytes are, as a fingerprint an engine's
own code can reproduce.

The same synthetic expert (:func:`synthetic_expert`: random bytes from a fixed seed, a format's
checkpoint form, a layer's dims cut to one :data:`PROBE_PERIOD`) is laid out by this package
(:func:`reference`, through the functions conversion writes with) and fingerprinted
(:func:`fingerprint`). A conversion's manifest records the transform's name, the seed, the fingerprint
and the engine releases the test suite proves it against (:func:`layout_identity`); ``verify``
recomputes it; at start-up, ``engines/probe.py`` runs the same input through the engine's own loading
code and compares tensor by tensor (:func:`difference`).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

import numpy as np
import torch
import xxhash

from megamoe_convert import jsonio
from megamoe_convert.layout import scales, sm90, transform
from megamoe_convert.source import formats
from megamoe_convert.source.formats import WeightFormat

_T = TypeVar("_T")

PROBE_SEED = 24301
#: The generator of the probe's input, recorded beside the seed: the fingerprints are of this input,
#: so a manifest that records another one is refused (:func:`identity_from_json`).
PROBE_INPUT = "pcg64-raw/1"
#: The transform this package writes, by the format's kernel (``layout/transform.py``): SM100's MegaMoE layout
#: (gate/up interleaved by 8 rows, scales packed MN-major and UTCCP-transposed), and SM90's FP8 one
#: (the same interleave, FP32 block scales as stored). A changed transform is a new name.
TRANSFORMS = {"sm100": "deepgemm-sm100-mega-moe/1", "sm90": "deepgemm-sm90-fp8-mega-moe/1"}
#: The probe's dims are the layer's cut to at most this, keeping each dim's residue modulo it (so
#: every block structure of the layout, 8/16-row interleave, 128-row UTCCP blocks, 4-byte scale
#: words, engines' 512 multiples, falls the same way) at a fraction of one expert's bytes.
PROBE_PERIOD = 1024
#: The releases whose own code the test suite runs the probe through (``tests/engines``), with the
#: DeepGEMM each bundles: what a recorded layout identity was proven against.
PROVEN = {"vllm": ("0.30.0", "0.31.0", "0.32.0", "0.33.0"), "sglang": ("0.5.23",), "deep_gemm": ("2.8.0", "2.8.1")}
#: Rows and columns one checkpoint block scale of a shared expert covers (DeepSeek's FP8 linears).
SHARED_BLOCK = 128
#: Safetensors dtype -> torch dtype of the checkpoint tensors the probe feeds.
CHECKPOINT_DTYPES = {"I8": torch.int8, "U8": torch.uint8, "F8_E8M0": torch.float8_e8m0fnu,
                     "F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F32": torch.float32}

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ProbeInput:
    """One synthetic routed expert (and, with ``shared_inter``, one shared expert) in checkpoint form:
    ``routed[(proj, kind)]`` with kind ``weight`` / ``scale`` ``[N, row bytes]`` in the format's first
    checkpoint dtypes, NVFP4's FP32 ``weight_scale_2`` / ``input_scale`` scalars; ``shared[(proj, kind)]``
    FP8 e4m3 weights and 128x128 UE8M0 block scales."""

    fmt: WeightFormat
    hidden: int
    inter: int
    shared_inter: int = 0
    routed: Mapping[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    shared: Mapping[tuple[str, str], torch.Tensor] = field(default_factory=dict)

    def stacked(self, projs: tuple[str, ...], kind: str) -> torch.Tensor:
        """``uint8 [1, rows, cols]``: the projections' bytes one after another (w13 is w1's rows, then
        w3's), as an engine's loader-side parameter holds one expert."""
        return torch.cat([self.routed[p, kind].view(torch.uint8) for p in projs]).unsqueeze(0)

    def describe(self) -> str:
        shared = f", shared {self.shared_inter}" if self.shared_inter else ""
        return f"{self.fmt.name}, hidden {self.hidden}, intermediate {self.inter}{shared}"


# --------------------------------------------------------------------------------------
# The synthetic expert
# --------------------------------------------------------------------------------------

def _finite(raw: torch.Tensor, element: str) -> torch.Tensor:
    """Random bytes made finite values of ``element`` (an engine may move them as floats)."""
    if element == "e4m3":  # 0x7F / 0xFF are e4m3fn's NaNs
        return torch.where(raw & 0x7F == 0x7F, raw ^ 0x01, raw)
    if element == "bf16":  # clear the exponent's top bit of each little-endian pair's high byte
        pairs = raw.view(*raw.shape[:-1], -1, 2).clone()
        pairs[..., 1] &= 0xBF
        return pairs.view(raw.shape)
    return raw


class RandomBytes:
    """The probe input's random bytes: NumPy's PCG64 raw stream from a seed. Bit generators' raw
    streams stay the same across NumPy releases (distributions' and torch's generators' outputs
    may not), and it is fast enough for a start-up probe (about a byte a nanosecond)."""

    def __init__(self, seed: int) -> None:
        self._generator = np.random.PCG64(seed)

    def take(self, *shape: int) -> torch.Tensor:
        """``uint8`` bytes of ``shape``: the stream's next little-endian 64-bit words, cut to size."""
        n = math.prod(shape)
        words = self._generator.random_raw(-(-n // 8)).astype("<u8", copy=False)
        return torch.from_numpy(words.view(np.uint8)[:n]).reshape(shape)

    def between(self, low: int, high: int, *shape: int) -> torch.Tensor:
        """``uint8`` values in ``low..high - 1`` (``high - low`` at most 256)."""
        return (self.take(*shape) % (high - low) + low).to(torch.uint8)

    def uniform(self, *shape: int) -> torch.Tensor:
        """``float32`` in ``[0, 1)``: 24 random bits of each 32-bit word."""
        bits = self.take(*shape, 4).view(torch.int32).squeeze(-1)
        return ((bits >> 8) & 0xFFFFFF).to(torch.float32) * 2.0 ** -24


def _scale_bytes(stream: RandomBytes, shape: tuple[int, ...], encoding: str | None) -> torch.Tensor:
    """Block-scale bytes of normal magnitude: UE8M0 exponents 2^-63..2^63, E4M3 positive normals,
    FP32 values in [0.5, 1.5) (``shape``: rows and bytes)."""
    if encoding == "fp32":
        return (stream.uniform(shape[0], shape[1] // 4) + 0.5).view(torch.uint8)
    low, high = (64, 191) if encoding == "ue8m0" else (0x08, 0x78)
    return stream.between(low, high, *shape)


def kernel_of(fmt: WeightFormat) -> str:
    """The kernel layout a format's experts are written in (``sm100`` unless the table says otherwise)."""
    return getattr(fmt, "kernel", "sm100")


def probe_dims(*dims: int) -> tuple[int, ...]:
    """Each dim cut to ``(d - 1) % PROBE_PERIOD + 1``: the same residue, at most one period."""
    return tuple((d - 1) % PROBE_PERIOD + 1 if d else 0 for d in dims)


def _as(raw: torch.Tensor, dtype: str, rows: int) -> torch.Tensor:
    """Bytes ``[rows, row bytes]`` as a checkpoint tensor of safetensors ``dtype``."""
    return raw.view(CHECKPOINT_DTYPES[dtype]).reshape(rows, -1)


def _on_cpu(fn: Callable[..., _T]) -> Callable[..., _T]:
    """Run ``fn`` with the CPU as torch's default device: an engine may call the probe inside a
    ``with torch.device("cuda")`` block (vLLM builds and loads its model under one), and the probe's
    input and the project's layout of it are made on the CPU, the same bytes on every machine."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> _T:
        with torch.device("cpu"):
            return fn(*args, **kwargs)
    return wrapper


@_on_cpu
def synthetic_expert(fmt: WeightFormat, hidden: int, inter: int, shared_inter: int = 0,
                     seed: int = PROBE_SEED) -> ProbeInput:
    """The probe's input: the same bytes for the same format, dims and seed, on every machine."""
    stream = RandomBytes(seed)
    routed: dict[tuple[str, str], torch.Tensor] = {}
    for (proj, kind), shape in formats.checkpoint_byte_shapes(fmt, hidden, inter).items():
        if kind == "weight":
            raw = _finite(stream.take(*shape), fmt.element)
            routed[proj, kind] = _as(raw, fmt.checkpoint_weight_dtypes[0], shape[0])
        elif kind == "scale":
            routed[proj, kind] = _as(_scale_bytes(stream, shape, fmt.scale_encoding), fmt.scale_dtypes[0], shape[0])
    if fmt.global_scales:  # one L1 scale per expert: w1's and w3's are equal
        values = stream.uniform(3) + 0.25
        for (proj, kind), value in zip(formats.GLOBAL_SCALE_TENSORS, (values[0], values[0], values[1], values[2]),
                                       strict=True):
            routed[proj, kind] = value.clone().reshape(())
    shared: dict[tuple[str, str], torch.Tensor] = {}
    if shared_inter:
        weight_dtype = CHECKPOINT_DTYPES[formats.SHARED_FORMAT.weight_dtype]
        for proj, (n, k) in formats.expert_matrix_shapes(hidden, shared_inter).items():
            raw = _finite(stream.take(n, k), "e4m3")
            shared[proj, "weight"] = raw.view(weight_dtype)
            blocks = (-(-n // SHARED_BLOCK), -(-k // SHARED_BLOCK))
            shared[proj, "scale"] = _scale_bytes(stream, blocks, "ue8m0").view(torch.float8_e8m0fnu)
    return ProbeInput(fmt, hidden, inter, shared_inter, routed, shared)


def routed_only(inp: ProbeInput, laid_out: Tensors) -> tuple[ProbeInput, Tensors]:
    """``inp`` (made with a shared expert) and its layout without the shared expert: the input and
    layout :func:`synthetic_expert` and :func:`reference` give for the same dims with ``shared_inter``
    0, since the routed bytes come first from the stream (an install whose modules fuse no shared
    expert probes the routed part alone)."""
    routed = {k: t for k, t in laid_out.items() if not k.startswith("shared_")}
    return ProbeInput(inp.fmt, inp.hidden, inp.inter, 0, inp.routed, {}), routed


# --------------------------------------------------------------------------------------
# The project's layout of it, and the comparison
# --------------------------------------------------------------------------------------

@_on_cpu
def reference(inp: ProbeInput) -> Tensors:
    """The conversion's kernel-form tensors of ``inp`` by rank-file key, through the functions
    conversion writes with (scales as the kernel's MN-major view; the shared expert without an
    expert dim, as the rank files hold it)."""
    fmt = inp.fmt
    if kernel_of(fmt) == "sm90":  # SGLang's FP8 layout: the L1 rows interleaved, FP32 block scales as stored
        l1, l2 = sm90.sm90_transform_experts(
            inp.stacked(("w1", "w3"), "weight"), inp.stacked(("w1", "w3"), "scale"),
            inp.stacked(("w2",), "weight"), inp.stacked(("w2",), "scale"))
        assert l1.sf is not None and l2.sf is not None  # FP8 block scales: always present
        return {"l1_weight": l1.weight, "l1_sf": l1.sf, "l2_weight": l2.weight, "l2_sf": l2.sf}
    weight = formats.torch_dtype(fmt.weight_dtype)
    out = {"l1_weight": transform.l1_weight(inp.stacked(("w1", "w3"), "weight")).view(weight),
           "l2_weight": transform.l2_weight(inp.stacked(("w2",), "weight")).view(weight)}
    if fmt.scaled:
        out["l1_sf"] = transform.l1_sf(inp.stacked(("w1", "w3"), "scale"))
        out["l2_sf"] = transform.l2_sf(inp.stacked(("w2",), "scale"))
    if fmt.global_scales:
        out["l1_global_scale"] = inp.routed["w1", formats.WEIGHT_GLOBAL_SCALE].reshape(1)
        out["l2_global_scale"] = inp.routed["w2", formats.WEIGHT_GLOBAL_SCALE].reshape(1)
        out["l2_input_scale"] = inp.routed["w2", "input_scale"].reshape(1)
        out["l2_input_scale_all"] = inp.routed["w2", "input_scale"].reshape(1)
    if inp.shared_inter:
        out.update(_shared_reference(inp))
    return out


def _shared_reference(inp: ProbeInput) -> Tensors:
    """The fused shared expert as ``rank_extras`` writes it: 128x128 scales expanded to 1x32 groups."""
    group = formats.SHARED_FORMAT.scale_group_k
    assert group is not None

    def sf(proj: str) -> torch.Tensor:
        n, k = inp.shared[proj, "weight"].shape
        return scales.expand_block_scales(inp.shared[proj, "scale"], n, k // group)

    w13 = torch.cat([inp.shared[p, "weight"].view(torch.uint8) for p in ("w1", "w3")]).unsqueeze(0)
    weight = formats.torch_dtype(formats.SHARED_FORMAT.weight_dtype)
    return {"shared_l1_weight": transform.l1_weight(w13).view(weight)[0],
            "shared_l1_sf": transform.l1_sf(torch.cat([sf("w1"), sf("w3")]).unsqueeze(0))[0],
            "shared_l2_weight":
                transform.l2_weight(inp.shared["w2", "weight"].view(torch.uint8).unsqueeze(0)).view(weight)[0],
            "shared_l2_sf": transform.l2_sf(sf("w2").unsqueeze(0))[0]}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values in logical order as bytes, on the host (NaN patterns compare as bytes)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def difference(got: torch.Tensor | None, want: torch.Tensor) -> str | None:
    """How the engine's tensor differs from the conversion's, or ``None`` when they are the same
    tensor: dtype, shape, strides (the kernel reads the view), then the first differing element."""
    if got is None:
        return "the engine's code left it unset"
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return f"the engine holds {got.dtype}{list(got.shape)}, the conversion {want.dtype}{list(want.shape)}"
    if got.dim() > 1 and got.stride() != want.stride():
        return f"the engine holds strides {list(got.stride())}, the conversion {list(want.stride())}"
    a, b = _bytes(got), _bytes(want)
    if torch.equal(a, b):  # the common answer, without a mask and an index of every byte
        return None
    differ = (a != b).nonzero()
    element = int(differ[0]) // want.element_size()
    index = list(torch.unravel_index(torch.tensor(element), tuple(want.shape))) if want.dim() else []
    return (f"first difference at element {[int(i) for i in index]} of {list(want.shape)}, "
            f"{len(differ)} of {a.numel()} bytes differ")


def fingerprint(tensors: Mapping[str, torch.Tensor]) -> str:
    """``xxh3_64:<hex>`` of every tensor's key, dtype, shape and bytes, in key order."""
    h = xxhash.xxh3_64()
    for key in sorted(tensors):
        t = tensors[key]
        h.update(f"{key}:{str(t.dtype).removeprefix('torch.')}:{list(t.shape)};".encode())
        h.update(_bytes(t).numpy().tobytes())
    return f"xxh3_64:{h.hexdigest()}"


def fingerprints(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{"routed": ..., "shared": ...}``: the routed experts' and (where there is one) the fused shared
    expert's fingerprints apart, since an engine fuses the shared expert or not at its own choosing."""
    shared = {k: t for k, t in tensors.items() if k.startswith("shared_")}
    out = {"routed": fingerprint({k: t for k, t in tensors.items() if k not in shared})}
    return {**out, "shared": fingerprint(shared)} if shared else out


def layout_fingerprints(fmt: WeightFormat, hidden: int, inter: int, shared_inter: int = 0) -> dict[str, str]:
    """:func:`fingerprints` of this package's layout of the probe's input for a layer of these dims."""
    return fingerprints(reference(synthetic_expert(fmt, *probe_dims(hidden, inter, shared_inter))))


def layout_identity(fmt: WeightFormat, hidden: int, inter: int, shared_inter: int = 0) -> dict[str, Any]:
    """What a manifest records of the layout it was written with (see the module docstring)."""
    return {"transform": TRANSFORMS[kernel_of(fmt)], "input": PROBE_INPUT, "seed": PROBE_SEED,
            "fingerprints": layout_fingerprints(fmt, hidden, inter, shared_inter),
            "proven": {name: list(versions) for name, versions in PROVEN.items()}}


#: ``xxh3_64:`` and 16 hex digits.
_FINGERPRINT = re.compile(r"xxh3_64:[0-9a-f]{16}")


def identity_from_json(record: Any, f: jsonio.Fields) -> dict[str, Any]:
    """A manifest's ``layout`` record, every field checked through the manifest's validating ``f``
    (:class:`jsonio.Fields`); one of another probe input or seed than this package's is refused, since
    its fingerprints say nothing of this package's layout of its own input."""
    f.obj(record, name="layout")
    probe_input, seed = f.str(record, "input", name="layout.input"), f.int(record, "seed", name="layout.seed")
    if (probe_input, seed) != (PROBE_INPUT, PROBE_SEED):
        raise f.fail(f"layout identity of another probe input (layout.input {jsonio.short(probe_input)}, "
                     f"layout.seed {seed}; this megamoe-convert's is {PROBE_INPUT!r}, seed {PROBE_SEED}): "
                     "convert again with this megamoe-convert")
    prints = f.obj(record, "fingerprints", name="layout.fingerprints")
    fingerprints_read = {}
    for part in ("routed", "shared"):
        if part in prints or part == "routed":
            value = f.str(prints, part, name=f"layout.fingerprints.{part}")
            if not _FINGERPRINT.fullmatch(value):
                raise f.fail(f"layout.fingerprints.{part} must be xxh3_64: and 16 hex digits, got {value[:40]!r}")
            fingerprints_read[part] = value
    proven = f.obj(record, "proven", name="layout.proven")
    return {"transform": f.str(record, "transform", name="layout.transform"), "input": probe_input, "seed": seed,
            "fingerprints": fingerprints_read,
            "proven": {str(name): [f.str(v, -1, name=f"layout.proven.{name}") for v in
                                   f.list(proven, name, name=f"layout.proven.{name}", max_len=256)]
                       for name in proven}}


def identity_problems(record: dict[str, Any], dims: Any) -> list[str]:
    """How a manifest's recorded layout identity differs from what this package writes for its ``dims``
    (``ModelDims``; empty: the same transform and fingerprints)."""
    want = layout_identity(dims.format, dims.hidden_size, dims.moe_intermediate_size, dims.shared_intermediate_size)
    problems = []
    if record["transform"] != want["transform"]:
        problems.append(f"layout.transform is {record['transform']!r}, this megamoe-convert writes "
                        f"{want['transform']!r}: convert again with this megamoe-convert")
    for part, value in want["fingerprints"].items():
        got = record["fingerprints"].get(part)
        if got != value:
            problems.append(f"layout.fingerprints.{part} is {got}, but this megamoe-convert's layout of the probe "
                            f"expert is {value}: the experts were written with another layout; convert again")
    return problems
