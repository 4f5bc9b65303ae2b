"""Reading a checkpoint of a supported model family: config, index, shard headers, and the expert tensors.

The family (``families.py``, from ``config.json``'s ``model_type``) says where the sizes are and
what every expert tensor is called; everything here works on the project's own layer names.

Only headers are read up front (a few MB for a TB checkpoint); tensor bytes are read later,
one expert at a time, by whoever needs them. Everything that can be checked without the
bytes is checked here, so a bad checkpoint fails in seconds with a message that names the
file or tensor, not after an hour of conversion.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import posixpath
import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

from megamoe_convert import jsonio
from megamoe_convert.errors import CheckpointError
from megamoe_convert.source import formats
from megamoe_convert.source.families import ModelFamily, TensorNames, detect
from megamoe_convert.source.formats import WeightFormat
from megamoe_convert.source.layer_spec import _ranges
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.model_dims import MAX_LAYERS, ModelDims, config_int, dims_from_config
from megamoe_convert.source.safetensors_io import (
    DTYPE_BITS,
    FileCache,
    SafetensorsHeader,
    TensorEntry,
    read_header,
)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
#: Names a converted directory reserves: never copied from a source (``manifest.json`` written last).
RESERVED_NAMES = re.compile(r"manifest(?:\.part-[0-9]+-of-[0-9]+)?\.json")

#: A shared expert's linears: gate, down, up (``layers.7.ffn.shared_experts.w1.weight``, ``.scale``).
SHARED_PROJECTIONS = ("w1", "w2", "w3")


def _index_file(name: Any, index_path: Path) -> str:
    """An index entry's file, as a plain path inside the checkpoint (``./x`` is ``x``)."""
    f = jsonio.Fields(index_path, CheckpointError)
    text = f.str(name, name="a weight_map entry")
    clean = posixpath.normpath(text) if text else ""
    if not clean or clean.startswith(("/", "../")) or clean in (".", "..") or "\\" in clean or "\x00" in clean:
        raise f.fail(f"weight_map entry {text!r} is not a file inside the checkpoint")
    return clean


@dataclass
class Checkpoint:
    """A checkpoint directory of a supported family, validated from its config and shard headers."""

    root: Path
    config: dict[str, Any]
    dims: ModelDims
    weight_map: dict[str, str]
    headers: dict[str, SafetensorsHeader]
    index_bytes: bytes
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    #: Why the shared expert is not pre-baked (``None`` when it is).
    shared_expert_note: str | None = None
    #: The model family (``families.py``) and its tensor names for this model.
    family: ModelFamily | None = None
    names: TensorNames | None = None

    # ---------------------------------------------------------------- opening
    @classmethod
    def open(cls, root: Path | str) -> "Checkpoint":
        root = Path(root)
        if not root.is_dir():
            raise CheckpointError(f"{root}: not a checkpoint directory")
        config_path = root / CONFIG_NAME
        if not os.path.lexists(config_path):
            raise CheckpointError(f"{root}: not a checkpoint directory (no {CONFIG_NAME})")
        config = jsonio.Fields(config_path, CheckpointError).obj(
            jsonio.read(config_path, CheckpointError, "config.json", jsonio.MAX_CONFIG_BYTES), name="config.json")
        family = detect(config, config_path)
        text = family.text(config, config_path)
        dims = dims_from_config(family, config, config_path)
        names = family.names(config_int(text, family.keys["layers"], config_path, 0, hi=MAX_LAYERS,
                                        name=family.where(family.keys["layers"])))
        weight_map, index_bytes = cls._read_index(root)
        headers = cls._read_headers(root, weight_map)
        ckpt = cls(root, config, dims, weight_map, headers, index_bytes, family=family, names=names)
        ckpt.tensors = ckpt._collect_tensors()
        ckpt.dims = replace(dims, weight_format=ckpt._identify_format().name)
        formats.check_quantization_config(ckpt.dims.format, config.get("quantization_config"), config_path)
        ckpt._check_experts()
        shared, ckpt.shared_expert_note = ckpt._fusable_shared_expert()
        ckpt.dims = replace(ckpt.dims, shared_intermediate_size=shared)
        return ckpt

    @classmethod
    def open_non_expert(cls, root: Path | str) -> dict[str, TensorEntry]:
        """The tensors a converted directory's index lists (its non-expert shards), validated
        like a source's: present in the named file, in no other file."""
        root = Path(root)
        weight_map, index_bytes = cls._read_index(root)
        ckpt = cls(root, {}, ModelDims(0, 0, 0), weight_map, cls._read_headers(root, weight_map), index_bytes)
        return ckpt._collect_tensors()

    @property
    def text_config(self) -> Any:
        """The config.json object holding the text model's fields (the family says which)."""
        assert self.family is not None
        return self.family.text(self.config)

    def top_k(self) -> int:
        """Experts per token, from the family's config key (2 when absent)."""
        assert self.family is not None
        value = self.text_config.get(self.family.keys["top_k"], 2)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 2

    @staticmethod
    def _read_index(root: Path) -> tuple[dict[str, str], bytes]:
        index_path = root / INDEX_NAME
        if index_path.exists() or index_path.is_symlink():
            index_bytes = jsonio.read_regular(index_path, CheckpointError, "safetensors index", jsonio.MAX_INDEX_BYTES)
            weight_map = jsonio.Fields(index_path, CheckpointError).obj(
                jsonio.parse(index_bytes, index_path, CheckpointError), "weight_map")
            if not weight_map:
                raise CheckpointError(f"{index_path}: empty 'weight_map' in the index")
            return {k: _index_file(v, index_path) for k, v in weight_map.items()}, index_bytes
        single = root / SINGLE_FILE_NAME
        if single.exists():
            names = read_header(single).tensors
            return {name: SINGLE_FILE_NAME for name in names}, b""
        raise CheckpointError(f"{root}: no {INDEX_NAME} (or {SINGLE_FILE_NAME}) found")

    @staticmethod
    def _read_headers(root: Path, weight_map: dict[str, str]) -> dict[str, SafetensorsHeader]:
        headers = {}
        for filename in sorted(set(weight_map.values())):
            path = root / filename
            if not path.is_file():
                raise CheckpointError(f"{root / INDEX_NAME}: index points at missing file {filename}")
            headers[filename] = read_header(path)
        return headers

    def _collect_tensors(self) -> dict[str, TensorEntry]:
        """Every tensor, found in the file the index names, and in no other file."""
        owner: dict[str, str] = {}
        for filename, header in self.headers.items():
            for name in header.tensors:
                if name in owner:
                    raise CheckpointError(f"{self.root}: duplicated tensor {name} in {owner[name]} and {filename}")
                owner[name] = filename
        tensors = {}
        for name, filename in self.weight_map.items():
            entry = self.headers[filename].tensors.get(name)
            if entry is None:
                raise CheckpointError(f"{self.root / filename}: tensor {name} listed in the index is not in this file")
            tensors[name] = entry
        for name, filename in owner.items():
            if name not in self.weight_map:
                raise CheckpointError(f"{self.root / filename}: tensor {name} is not listed in {INDEX_NAME}")
        return tensors

    # ---------------------------------------------------------------- experts
    @cached_property
    def layers(self) -> list[MoELayer]:
        """MoE layers with expert tensors, decoder layers first, then MTP, in order."""
        assert self.names is not None
        return sorted({found[0] for name in self.tensors if (found := self.names.parse_expert(name))})

    def _identify_format(self) -> WeightFormat:
        """The routed experts' format, from the first expert's ``w1`` tensors (every other expert
        tensor is then checked against it)."""
        assert self.names is not None
        if not self.layers:
            raise self._no_experts()
        first = self.layers[0]
        weight = self.tensors.get(self.expert_name(first, 0, "w1", "weight"))
        if weight is None:
            raise CheckpointError(f"{self.root}: missing expert tensor {self.expert_name(first, 0, 'w1', 'weight')}")
        scale = self.tensors.get(self.expert_name(first, 0, "w1", "scale"))
        return formats.identify(weight.dtype, None if scale is None else scale.dtype,
                                f"{weight.path}: {self.names.block(first)}.experts.0.w1")

    def _check_experts(self) -> None:
        self._check_no_stray_expert_tensors()
        self._check_layer_set()
        shapes = self.dims.expert_byte_shapes()
        for layer in self.layers:
            for expert in range(self.dims.experts_of(layer)):
                for (proj, kind), shape in shapes.items():
                    self._check_expert_tensor(self.expert_name(layer, expert, proj, kind), kind, shape)

    def _check_no_stray_expert_tensors(self) -> None:
        assert self.names is not None and self.family is not None
        for name in self.tensors:
            if not self.names.under_experts(name):
                continue
            found = self.names.parse_expert(name)
            if found is None or (found[2], found[3]) not in self.dims.expert_byte_shapes():
                pattern = self.names.expected_pattern({kind for _, kind in self.dims.expert_byte_shapes()})
                raise CheckpointError(f"{self.file_of(name)}: unexpected expert tensor {name} (expected "
                                      f"{pattern} of {self.dims.weight_format} experts)")
            n = self.dims.experts_of(found[0])
            if found[1] >= n:
                key = self.family.keys["mtp_experts" if n != self.dims.n_routed_experts else "experts"]
                raise CheckpointError(f"{self.file_of(name)}: tensor {name} names expert {found[1]}, "
                                      f"but config.json has {self.family.where(key)}={n}")

    def _no_experts(self) -> CheckpointError:
        assert self.names is not None and self.family is not None
        return CheckpointError(f"{self.root}: no routed-expert tensors ({self.names.example()}) found "
                               f"({self.family.title} naming)")

    def _check_layer_set(self) -> None:
        """The layers with experts must be exactly the family's MoE layers for config.json's counts."""
        assert self.family is not None and self.names is not None
        config_path, family, text = self.root / CONFIG_NAME, self.family, self.text_config
        found_decoder = sorted(layer.index for layer in self.layers if not layer.is_mtp)
        found_mtp = sorted(layer.index for layer in self.layers if layer.is_mtp)
        n_layers = config_int(text, family.keys["layers"], config_path, len(found_decoder), hi=MAX_LAYERS,
                              name=family.where(family.keys["layers"]))
        dense_rule = [config_int(text, key, config_path, default, hi=MAX_LAYERS, name=family.where(key))
                     if key else default for key, default in ((family.first_dense_key, 0), (family.freq_key, 1))]
        want_decoder = family.moe_layer_indices(n_layers, *dense_rule)
        mtp_key = family.keys["mtp_layers"]
        want_mtp = list(range(config_int(text, mtp_key, config_path, len(found_mtp), hi=MAX_LAYERS,
                                         name=family.where(mtp_key))))
        if not self.layers:
            raise self._no_experts()
        if found_decoder != want_decoder:
            rule = "".join(f", {family.where(k)}={v}" for k, v in zip((family.first_dense_key, family.freq_key),
                                                                      dense_rule, strict=True) if k)
            gives = f" (MoE layers {_ranges(want_decoder) or 'none'})" if rule else ""
            raise CheckpointError(f"{config_path}: {family.where(family.keys['layers'])}={n_layers}{rule}{gives} "
                                  f"but the checkpoint has experts for decoder layers {_ranges(found_decoder)}")
        if found_mtp != want_mtp:
            raise CheckpointError(f"{config_path}: {family.where(mtp_key)}={len(want_mtp)} but the checkpoint has "
                                  f"experts for MTP layers {_ranges(found_mtp) or 'none'}")

    def _check_expert_tensor(self, name: str, kind: str, byte_shape: tuple[int, ...]) -> None:
        entry = self.tensors.get(name)
        fmt = self.dims.format
        if entry is None:
            raise CheckpointError(f"{self.root}: missing expert tensor {name} ({fmt.name} experts)")
        allowed = formats.checkpoint_dtypes(fmt, kind)
        if entry.dtype not in allowed:
            raise CheckpointError(f"{entry.path}: {name} has dtype {entry.dtype}, expected one of {', '.join(allowed)} "
                                  f"({fmt.name} experts)")
        if kind == "scale" and fmt.scale_encoding == "fp32":  # FP32 values stored as F32, BF16 or F16
            byte_shape = (byte_shape[0], byte_shape[1] // fmt.scale_bytes * DTYPE_BITS[entry.dtype] // 8)
        if entry.byte_shape != byte_shape:
            bits = DTYPE_BITS[entry.dtype]
            logical = [*byte_shape[:-1], byte_shape[-1] * 8 // bits] if len(byte_shape) == 2 else "one value"
            raise CheckpointError(f"{entry.path}: {name} has shape {list(entry.shape)}, expected {logical} "
                                  f"(hidden_size={self.dims.hidden_size}, moe_intermediate_size="
                                  f"{self.dims.moe_intermediate_size} in config.json; {fmt.name} experts)")

    def check_block_scales(self, files: FileCache, layers: Sequence[MoELayer]) -> None:
        """Every FP32-encoded block scale (FP8 128x128 experts) of ``layers`` finite. A NaN or an
        infinity there makes its whole block NaN in the kernel, and a verbatim copy of it would
        verify as equal, so it is the source's problem, refused before anything is written. A few
        KB per expert, small next to its weights; other formats' scales are checked elsewhere."""
        if self.dims.format.scale_encoding != "fp32":
            return
        for layer in layers:
            for expert in range(self.dims.experts_of(layer)):
                for proj in ("w1", "w3", "w2"):
                    entry = self.expert_entry(layer, expert, proj, "scale")
                    values = formats.fp32_block_scales(files.read(entry), entry.dtype)
                    if not bool(values.isfinite().all()):
                        row, col = (~values.isfinite()).nonzero()[0].tolist()
                        value = values[row, col].item()
                        raise CheckpointError(f"{entry.path}: {entry.name} is {value} at block [{row}, {col}]; "
                                              f"{self.dims.weight_format} block scales must be finite (the source "
                                              "checkpoint is damaged)")

    def _fusable_shared_expert(self) -> tuple[int, str | None]:
        """``(S, None)`` when every MoE layer has a shared expert of intermediate size ``S`` that
        can run inside the MegaMoE launch (:func:`formats.shared_expert_problem`), else ``(0, why)``."""
        h, i = self.dims.hidden_size, self.dims.moe_intermediate_size
        assert self.family is not None
        if not self.family.fuses_shared_expert:
            return 0, f"{self.family.title} runs its shared expert outside the MegaMoE launch"
        if not self.dims.format.fuses_fp8_shared:
            return 0, f"{self.dims.weight_format} experts fuse no {formats.SHARED_FORMAT.name} shared expert"
        sizes = set()
        for layer in self.layers:
            w1 = self.tensors.get(self.shared_name(layer, "w1", "weight"))
            if w1 is None or len(w1.shape) != 2:
                return 0, f"{layer.key} has no shared expert"
            s = w1.shape[0]
            for proj, (n, k) in (("w1", (s, h)), ("w3", (s, h)), ("w2", (h, s))):
                weight, scale = (self.tensors.get(self.shared_name(layer, proj, kind)) for kind in ("weight", "scale"))
                if weight is None or scale is None:
                    return 0, f"{layer.key} has no shared_experts.{proj} weight and scale"
                problem = formats.shared_expert_problem(weight.dtype, weight.shape, scale.dtype, scale.shape, n, k)
                if problem:
                    return 0, f"{self.shared_name(layer, proj, 'weight')}: {problem}"
            if s % i:
                return 0, f"{layer.key}: shared intermediate {s} is not a multiple of moe_intermediate_size {i}"
            sizes.add(s)
        if len(sizes) != 1:
            return 0, f"shared experts of different sizes {sorted(sizes)}"
        return sizes.pop(), None

    def expert_name(self, layer: MoELayer, expert: int, proj: str, kind: str) -> str:
        """The checkpoint's name of one expert tensor (the family's naming)."""
        assert self.names is not None
        return self.names.expert(layer, expert, proj, kind)

    def shared_name(self, layer: MoELayer, proj: str, kind: str) -> str:
        assert self.names is not None
        return self.names.shared(layer, proj, kind)

    def shared_entry(self, layer: MoELayer, proj: str, kind: str) -> TensorEntry:
        return self.tensors[self.shared_name(layer, proj, kind)]

    def expert_entry(self, layer: MoELayer, expert: int, proj: str, kind: str) -> TensorEntry:
        return self.tensors[self.expert_name(layer, expert, proj, kind)]

    def file_of(self, name: str) -> Path:
        return self.root / self.weight_map[name]

    # ---------------------------------------------------------------- everything else
    def non_expert_tensors(self) -> list[TensorEntry]:
        """Tensors that are not routed experts, in file then offset order (sequential reads)."""
        assert self.names is not None
        rest = [e for name, e in self.tensors.items() if not self.names.under_experts(name)]
        return sorted(rest, key=lambda e: (e.path.name, e.begin))

    def small_files(self) -> list[Path]:
        """Files copied verbatim: config, tokenizer, generation config, licence... (not shards)."""
        return sorted(p for p in self.root.iterdir()
                      if p.is_file() and not p.name.startswith(".") and p.suffix != ".safetensors"
                      and p.name != INDEX_NAME and not RESERVED_NAMES.fullmatch(p.name))

    def expert_bytes(self) -> int:
        return self.dims.bytes_per_expert() * sum(self.dims.experts_of(layer) for layer in self.layers)

    def source_record(self) -> dict[str, Any]:
        """What identifies the source: path, every shard's size, the index's hash, a hash of
        every tensor's name, dtype, shape and offsets, and the hub commit of a snapshot in the
        Hugging Face cache (``None`` for a plain directory). Reading the data bytes themselves
        would cost as much as the conversion, so they are not hashed."""
        return {
            "path": str(self.root.resolve()),
            "files": {name: h.file_size for name, h in sorted(self.headers.items())},
            "index_sha256": hashlib.sha256(self.index_bytes).hexdigest(),
            "tensors_sha256": self.tensors_sha256,
            "revision": hub_snapshot_commit(self.root),
        }

    @functools.cached_property
    def tensors_sha256(self) -> str:
        """Hash of the tensor table (name, file, dtype, shape, offsets); computed once, since every
        fingerprint and manifest asks for it and a real checkpoint lists ~100k tensors."""
        table = sorted((e.name, e.path.name, e.dtype, list(e.shape), e.begin, e.end) for e in self.tensors.values())
        return hashlib.sha256(json.dumps(table).encode()).hexdigest()


#: ``.../models--owner--name/snapshots/<commit>``: where huggingface_hub puts a repo's files.
HUB_SNAPSHOT = re.compile(r"/models--[^/]+/snapshots/([0-9a-f]{40})$")


def hub_snapshot_commit(root: Path) -> str | None:
    """The commit a Hugging Face cache snapshot directory holds, or ``None`` for any other path."""
    match = HUB_SNAPSHOT.search(Path(root).resolve().as_posix())
    return match.group(1) if match else None
