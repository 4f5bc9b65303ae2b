"""The layout probe: before an install changes any module, the engine's own loading code lays out
one synthetic expert, and its bytes must be this conversion's layout of the same input.

The contract, EP numbers, dtypes, shapes and strides are all checked before an install; an engine
or DeepGEMM release that lays the same shapes out in another byte order passes every one of those
checks. Only the engine's code, run in the serving process, can say which order it uses, so each
contract hands :func:`check_layout` a callable that feeds a :class:`ProbeInput` (random bytes from
a fixed seed, the layer's real format and dims, in the checkpoint's form) through the engine's own
loader or transform on a scratch twin of a real module (:func:`scratch_twin`: nothing of the real
module is written), and returns what the engine made of it, by rank-file key, in kernel form.
:func:`reference` is the project's layout of the same input (the functions conversion writes with).
A difference refuses in one line naming the engine, the tensor and what to do; a probe that cannot
run refuses too, unless the caller opted out (``probe=False`` or ``MEGAMOE_LAYOUT_PROBE=0``), which
is logged as unchecked on every install.

The fingerprint of the reference on the fixed seed is the conversion's *layout identity*
(:func:`layout_identity`): the manifest records it, ``verify`` recomputes it, and an install checks
that the engine's bytes hash to the recorded value, i.e. that the engine lays out exactly as the
conversion was written.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from importlib import metadata, util
from typing import Any, Callable, Mapping

import torch
import xxhash
from torch import nn

from megamoe_convert import layout
from megamoe_convert.errors import InstallError
from megamoe_convert.source import formats
from megamoe_convert.source.formats import WeightFormat

log = logging.getLogger(__name__)

#: The seed every probe and every recorded fingerprint use: the same input everywhere.
PROBE_SEED = 24301
#: The transform this package writes, by the format's kernel (``layout.py``): SM100's MegaMoE layout
#: (gate/up interleaved by 8 rows, scales packed MN-major and UTCCP-transposed), and SM90's FP8 one
#: (the same interleave, FP32 block scales as stored). A changed transform is a new name.
TRANSFORMS = {"sm100": "deepgemm-sm100-mega-moe/1", "sm90": "deepgemm-sm90-fp8-mega-moe/1"}
#: The probe's dims are the layer's cut to at most this, keeping each dim's residue modulo it (so
#: every block structure of the layout, 8/16-row interleave, 128-row UTCCP blocks, 4-byte scale
#: words, engines' 512 multiples, falls the same way) at a fraction of one expert's bytes.
PROBE_PERIOD = 1024
#: ``0`` / ``off`` / ``false``: install without the probe (logged as unchecked on every install).
OPT_OUT_ENV = "MEGAMOE_LAYOUT_PROBE"
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


def _scale_bytes(g: torch.Generator, shape: tuple[int, ...], encoding: str | None) -> torch.Tensor:
    """Block-scale bytes of normal magnitude: UE8M0 exponents 2^-63..2^63, E4M3 positive normals,
    FP32 values in [0.5, 1.5) (``shape``: rows and bytes)."""
    if encoding == "fp32":
        return (torch.rand(shape[0], shape[1] // 4, generator=g) + 0.5).view(torch.uint8)
    low, high = (64, 191) if encoding == "ue8m0" else (0x08, 0x78)
    return torch.randint(low, high, shape, dtype=torch.uint8, generator=g)


def kernel_of(fmt: WeightFormat) -> str:
    """The kernel layout a format's experts are written in (``sm100`` unless the table says otherwise)."""
    return getattr(fmt, "kernel", "sm100")


def probe_dims(*dims: int) -> tuple[int, ...]:
    """Each dim cut to ``(d - 1) % PROBE_PERIOD + 1``: the same residue, at most one period."""
    return tuple((d - 1) % PROBE_PERIOD + 1 if d else 0 for d in dims)


def _as(raw: torch.Tensor, dtype: str, rows: int) -> torch.Tensor:
    """Bytes ``[rows, row bytes]`` as a checkpoint tensor of safetensors ``dtype``."""
    return raw.view(CHECKPOINT_DTYPES[dtype]).reshape(rows, -1)


def synthetic_expert(fmt: WeightFormat, hidden: int, inter: int, shared_inter: int = 0,
                     seed: int = PROBE_SEED) -> ProbeInput:
    """The probe's input: the same bytes for the same format, dims and seed, on every machine."""
    g = torch.Generator().manual_seed(seed)
    routed: dict[tuple[str, str], torch.Tensor] = {}
    for (proj, kind), shape in formats.checkpoint_byte_shapes(fmt, hidden, inter).items():
        if kind == "weight":
            raw = _finite(torch.randint(0, 256, shape, dtype=torch.uint8, generator=g), fmt.element)
            routed[proj, kind] = _as(raw, fmt.checkpoint_weight_dtypes[0], shape[0])
        elif kind == "scale":
            routed[proj, kind] = _as(_scale_bytes(g, shape, fmt.scale_encoding), fmt.scale_dtypes[0], shape[0])
    if fmt.global_scales:  # one L1 scale per expert: w1's and w3's are equal
        values = torch.rand(3, generator=g, dtype=torch.float32) + 0.25
        for (proj, kind), value in zip(formats.GLOBAL_SCALE_TENSORS, (values[0], values[0], values[1], values[2])):
            routed[proj, kind] = value.clone().reshape(())
    shared: dict[tuple[str, str], torch.Tensor] = {}
    if shared_inter:
        weight_dtype = CHECKPOINT_DTYPES[formats.SHARED_FORMAT.weight_dtype]
        for proj, (n, k) in formats.expert_matrix_shapes(hidden, shared_inter).items():
            raw = _finite(torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g), "e4m3")
            shared[proj, "weight"] = raw.view(weight_dtype)
            blocks = (-(-n // SHARED_BLOCK), -(-k // SHARED_BLOCK))
            shared[proj, "scale"] = _scale_bytes(g, blocks, "ue8m0").view(torch.float8_e8m0fnu)
    return ProbeInput(fmt, hidden, inter, shared_inter, routed, shared)


# --------------------------------------------------------------------------------------
# The project's layout of it, and the comparison
# --------------------------------------------------------------------------------------

def reference(inp: ProbeInput) -> Tensors:
    """The conversion's kernel-form tensors of ``inp`` by rank-file key, through the functions
    conversion writes with (scales as the kernel's MN-major view; the shared expert without an
    expert dim, as the rank files hold it)."""
    fmt = inp.fmt
    weight = formats.torch_dtype(fmt.weight_dtype)
    out = {"l1_weight": layout.l1_weight(inp.stacked(("w1", "w3"), "weight")).view(weight),
           "l2_weight": layout.l2_weight(inp.stacked(("w2",), "weight")).view(weight)}
    if fmt.scaled and kernel_of(fmt) == "sm90":  # FP32 block scales, as stored
        out["l1_sf"] = inp.stacked(("w1", "w3"), "scale").view(torch.float32)
        out["l2_sf"] = inp.stacked(("w2",), "scale").view(torch.float32)
    elif fmt.scaled:
        out["l1_sf"] = layout.l1_sf(inp.stacked(("w1", "w3"), "scale"))
        out["l2_sf"] = layout.l2_sf(inp.stacked(("w2",), "scale"))
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
        return layout.expand_block_scales(inp.shared[proj, "scale"], n, k // group)

    w13 = torch.cat([inp.shared[p, "weight"].view(torch.uint8) for p in ("w1", "w3")]).unsqueeze(0)
    weight = formats.torch_dtype(formats.SHARED_FORMAT.weight_dtype)
    return {"shared_l1_weight": layout.l1_weight(w13).view(weight)[0],
            "shared_l1_sf": layout.l1_sf(torch.cat([sf("w1"), sf("w3")]).unsqueeze(0))[0],
            "shared_l2_weight": layout.l2_weight(inp.shared["w2", "weight"].view(torch.uint8).unsqueeze(0)).view(weight)[0],
            "shared_l2_sf": layout.l2_sf(sf("w2").unsqueeze(0))[0]}


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
    differ = (a != b).nonzero()
    if not len(differ):
        return None
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


def layout_fingerprint(fmt: WeightFormat, hidden: int, inter: int, shared_inter: int = 0) -> str:
    """The fingerprint of this package's layout of the probe's input for a layer of these dims."""
    return fingerprint(reference(synthetic_expert(fmt, *probe_dims(hidden, inter, shared_inter))))


def layout_identity(fmt: WeightFormat, hidden: int, inter: int, shared_inter: int = 0) -> dict[str, Any]:
    """What a manifest records of the layout it was written with (see the module docstring)."""
    return {"transform": TRANSFORMS[kernel_of(fmt)], "seed": PROBE_SEED,
            "fingerprint": layout_fingerprint(fmt, hidden, inter, shared_inter),
            "proven": {name: list(versions) for name, versions in PROVEN.items()}}


# --------------------------------------------------------------------------------------
# Running an engine's probe: once per process per engine and input
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayoutProbe:
    """One contract's probe of one module: ``engine`` names the engine, its version and its DeepGEMM
    (``vLLM 0.33.0 (DeepGEMM 2.8.1)``); ``where`` the module whose twin runs it; ``run`` feeds the
    input through the engine's own code and returns its kernel-form tensors by rank-file key."""

    engine: str
    where: str
    run: Callable[[ProbeInput], Tensors]
    contract: str = ""


#: (engine, contract, format, hidden, intermediate, shared) -> the fingerprint that passed.
_passed: dict[tuple[Any, ...], str] = {}


def enabled(probe: bool | None = None) -> bool:
    """Whether to probe: the caller's ``probe``, else the environment (on unless ``MEGAMOE_LAYOUT_PROBE``
    is ``0`` / ``off`` / ``false`` / ``no``)."""
    if probe is not None:
        return probe
    return os.environ.get(OPT_OUT_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def check_layout(probe: LayoutProbe, fmt: WeightFormat, hidden: int, inter: int, shared_inter: int = 0,
                 recorded: str | None = None) -> str:
    """Run ``probe`` once per process for this engine and input (a failure is never remembered, so
    every install refuses), compare with :func:`reference`, and with the conversion's ``recorded``
    fingerprint when it has one. Returns the fingerprint; raises :class:`InstallError` in one line."""
    dims = probe_dims(hidden, inter, shared_inter)
    key = (probe.engine, probe.contract, fmt.name, *dims)
    done = _passed.get(key)
    if done is None:
        inp = synthetic_expert(fmt, *dims)
        want = reference(inp)
        try:
            got = probe.run(inp)
        except Exception as e:  # the engine's own code: whatever it raises, the layout is unknown
            raise InstallError(f"{probe.engine}: the layout probe cannot run the engine's own loading code on "
                               f"{probe.where} ({type(e).__name__}: {_one_line(e)}); install what the engine runs "
                               f"MegaMoE with, or pass probe=False / set {OPT_OUT_ENV}=0 to serve unchecked") from e
        for name in want:
            why = difference(got.get(name), want[name])
            if why:
                raise InstallError(f"{probe.engine}: its own loading code lays out {probe.where} "
                                   f"{formats.FILE_NAMES[name]} ({inp.describe()}) differently from this "
                                   f"conversion: {why}; do not serve this conversion with it: use an engine "
                                   f"release megamoe-convert proves ({_proven()}), or serve the original "
                                   "checkpoint without --load-format megamoe")
        done = _passed[key] = fingerprint(want)
        log.info("megamoe: layout probe passed: %s lays out %s as megamoe-convert does (%s)",
                 probe.engine, inp.describe(), done)
    if recorded is not None and recorded != done:
        raise InstallError(f"{probe.engine}: the conversion records layout fingerprint {recorded}, but this "
                           f"engine's own loading code gives {done} for {probe.where}: it was written with "
                           "another layout; convert it again with this megamoe-convert")
    return done


def skipped(where: str) -> None:
    """The caller opted out: say so on every install (never silently)."""
    log.warning("megamoe: layout probe skipped (probe=False or %s=0) for %s: the engine's byte layout "
                "is unchecked", OPT_OUT_ENV, where)


def forget() -> None:
    """Forget every passed probe (a later install probes again)."""
    _passed.clear()


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _proven() -> str:
    return "; ".join(f"{name} {', '.join(v)}" for name, v in PROVEN.items() if name != "deep_gemm")


# --------------------------------------------------------------------------------------
# Helpers every engine's probe uses
# --------------------------------------------------------------------------------------

def scratch_twin(module: nn.Module, parameters: Mapping[str, torch.Tensor], **attributes: Any) -> nn.Module:
    """A scratch copy of ``module`` the engine's own methods can run on without touching it: its
    ``parameters`` are new Parameters (each with the real one's attributes: ``weight_loader``,
    ``quant_method``...), every other parameter ``None``; buffers and tensor attributes cloned,
    dict / list / set attributes copied, children shared (the probes call nothing of them);
    ``attributes`` set on the twin (e.g. one local expert slot)."""
    twin = object.__new__(type(module))
    state = {}
    for name, value in vars(module).items():
        if isinstance(value, torch.Tensor):
            value = value.clone()
        elif isinstance(value, (dict, list, set)):
            value = copy.copy(value)
        state[name] = value
    real = module._parameters
    state["_parameters"] = {name: None for name in real}
    state["_buffers"] = {name: None if b is None else b.clone() for name, b in module._buffers.items()}
    twin.__dict__.update(state)
    for name, data in parameters.items():
        param = nn.Parameter(data, requires_grad=False)
        if real.get(name) is not None:
            for attr, value in vars(real[name]).items():
                if getattr(value, "__self__", None) is module:  # a loader bound to the real module: to the twin
                    value = value.__func__.__get__(twin, type(twin))
                setattr(param, attr, value)
        twin._parameters[name] = param
    for name, value in attributes.items():
        setattr(twin, name, value)
    return twin


def like(param: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
    """A zero tensor of ``shape`` laid out like ``param``: its dims in ``param``'s memory order (a scale
    parameter's MN-major view stays MN-major), on its device, of its dtype unless ``dtype``."""
    order = sorted(range(param.dim()), key=lambda d: (param.stride(d), d), reverse=True)
    storage = torch.zeros([shape[d] for d in order], dtype=dtype or param.dtype, device=param.device)
    return storage.permute([order.index(d) for d in range(len(order))])


def package_version(name: str) -> str | None:
    """The installed version of a distribution, or ``None``."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def module_version(name: str) -> str | None:
    """``__version__`` of the module ``import name`` would give, without importing it where it is not
    imported yet (DeepGEMM's import initialises CUDA); ``None`` when there is none."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        return getattr(loaded, "__version__", None) or "unknown"
    try:
        spec = util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    try:
        with open(spec.origin, encoding="utf-8", errors="replace") as f:
            found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
    except OSError:
        return None
    return found[1] if found else (package_version(name.replace("_", "-")) or "unknown")
