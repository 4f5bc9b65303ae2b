"""Model families: which checkpoints megamoe-convert reads, and how each one names its MoE tensors.

``config.json``'s ``model_type`` says which family a checkpoint is. Each family says where its
sizes live in ``config.json``, which of its layers hold MegaMoE experts, and the checkpoint name
of every routed-expert and shared-expert tensor. Nothing else in the package knows a family's
config keys or tensor names: checkpoint reading, ``synth``, ``verify`` and the load formats ask
this table. Everywhere else layers have the project's own names (``layers.7`` / ``mtp.0``, and
``layers.7.ffn.experts.*`` in the rank files), whatever the family.

==============  ============  ===================================================  ===============================
family          model_type    routed expert ``w1`` (weight, scale)                 what vLLM 0.33 builds
==============  ============  ===================================================  ===============================
DeepSeek-V4     deepseek_v4   ``layers.L.ffn.experts.E.w1.weight``, ``.scale``     EPLB redundant experts, fused
                                                                                   shared expert, MTP ``mtp.K``
DeepSeek-V4.1   deepseek_v41  the same (sizes under ``text_config``)               the same; its MTP is DSpark's
                                                                                   draft (``dspark_n_routed_experts``
                                                                                   experts, pre-baked with that count)
Kimi-K3         kimi_k3       ``language_model.model.layers.L.block_sparse_moe.``  latent MoE (hidden =
                              ``experts.E.w1.weight_packed``, ``.weight_scale``    ``routed_expert_hidden_size``),
                                                                                   SiTU, no redundant experts, the
                                                                                   shared expert outside the launch
DeepSeek-V3/R1  deepseek_v3   ``model.layers.L.mlp.experts.E.gate_proj.weight``,   nothing (SGLang only: its SM90
                              ``.weight_scale_inv`` (FP8, 128x128 FP32 blocks)     FP8 MegaMoE); MTP ``layers.61``
Qwen3-MoE       qwen3_moe     the same names                                       nothing (SGLang only); no MTP
GLM-4.5/4.6     glm4_moe      the same names                                       nothing; SGLang 0.5.23 neither
==============  ============  ===================================================  ===============================

Which engine serves which family is the serving table's (``engines_table.py``), not a family's.
``w1`` / ``w3`` / ``w2`` are the project's names of an expert's gate, up and down projections; a
family whose checkpoint calls them otherwise (``gate_proj`` / ``up_proj`` / ``down_proj``) says so in
``projections``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Mapping

from megamoe_convert import jsonio
from megamoe_convert.errors import FamilyError
from megamoe_convert.source.layers import NUMBER

if TYPE_CHECKING:
    from megamoe_convert.source.layers import MoELayer

#: The canonical kinds of one expert projection's tensors (``formats.checkpoint_byte_shapes``).
KINDS = ("weight", "scale", "weight_scale_2", "input_scale")
#: The project's names of an expert's projections: gate, down, up.
PROJECTIONS = ("w1", "w2", "w3")


@dataclass(frozen=True)
class ModelFamily:
    """One model family: its config keys, which layers are MoE, and its checkpoint tensor names."""

    name: str  # the manifest's ``family``
    title: str
    model_types: tuple[str, ...]
    #: The config.json object holding the text model's fields: ``None`` for the top level.
    text_key: str | None
    #: Config key of ``hidden`` (the MegaMoE hidden size: Kimi-K3's latent width), ``intermediate``,
    #: ``experts``, ``top_k``, ``layers`` and ``mtp_layers``; where the MTP layers have their own
    #: expert count, ``mtp_experts`` (0 or absent in config.json: the decoder's).
    keys: Mapping[str, str]
    #: A decoder layer's MoE block in the checkpoint, ``{index}`` its number.
    block: str
    #: An MTP block's MoE block; ``None``: MTP blocks are numbered after the decoder layers with
    #: ``block``'s naming.
    mtp_block: str | None
    #: Checkpoint suffix of each canonical kind (``weight`` -> ``weight_packed``).
    kinds: Mapping[str, str] = field(default_factory=lambda: {k: k for k in KINDS})
    #: vLLM can run the family's shared expert inside the MegaMoE launch (``shared_l*``).
    fuses_shared_expert: bool = True
    #: The routed experts' gated activation: ``swiglu`` (``swiglu_limit`` clamp) or ``situ``.
    activation: str = "swiglu"
    #: The routed-expert weight formats (``formats.FORMATS`` names) the family's checkpoints come in:
    #: what ``synth --format`` may write for it.
    weight_formats: tuple[str, ...] = ("mxfp4", "mxfp8", "nvfp4", "bf16")
    #: Decoder layers before ``first_dense`` are dense, then every ``freq``-th is MoE (config keys;
    #: ``None``: every decoder layer is MoE).
    first_dense_key: str | None = None
    freq_key: str | None = None
    #: Checkpoint name of each projection (``w1`` gate, ``w3`` up, ``w2`` down).
    projections: Mapping[str, str] = field(default_factory=lambda: {p: p for p in PROJECTIONS})
    #: SGLang builds the MTP (NextN) layer like a decoder layer: with expert location and redundant
    #: experts (DeepSeek-V3's ``DeepseekV2MoE``), not DeepSeek-V4's plain slot-p-holds-p layer.
    sglang_mtp_like_decoder: bool = False

    # ---------------------------------------------------------------- config.json
    def text(self, config: Mapping[str, Any], where: object = "config.json") -> Mapping[str, Any]:
        """The object holding the text model's fields (``text_config`` or config.json itself);
        ``where`` names the file in the error."""
        if self.text_key is None:
            return config
        text = config.get(self.text_key)
        if not isinstance(text, Mapping):
            raise FamilyError(f"{where}: {self.title} config.json has no {self.text_key!r} object")
        return text

    def where(self, key: str) -> str:
        """How an error names a config field: ``'hidden_size'`` or ``'text_config.hidden_size'``."""
        return f"{self.text_key}.{key}" if self.text_key else key

    def expert_dtype(self, config: Mapping[str, Any]) -> Any:
        """DeepSeek's ``expert_dtype`` (top level, text_config or quantization_config; default fp4)."""
        for holder in (config, self.text(config), config.get("quantization_config") or {}):
            if isinstance(holder, Mapping) and "expert_dtype" in holder:
                return holder["expert_dtype"]
        return "fp4"

    def moe_layer_indices(self, num_hidden_layers: int, first_dense: int = 0, freq: int = 1) -> list[int]:
        """Decoder layers holding MoE experts (``KimiDecoderLayer.is_moe_layer``'s rule)."""
        return [i for i in range(num_hidden_layers) if i >= first_dense and i % max(freq, 1) == 0]

    def names(self, num_hidden_layers: int) -> "TensorNames":
        return TensorNames(self, num_hidden_layers)


@dataclass(frozen=True)
class TensorNames:
    """A family's checkpoint tensor names for a model of ``num_hidden_layers`` decoder layers
    (Kimi-K3 numbers MTP blocks after them)."""

    family: ModelFamily
    num_hidden_layers: int

    def block(self, layer: "MoELayer") -> str:
        """The layer's MoE block in the checkpoint: ``layers.7.ffn``,
        ``language_model.model.layers.7.block_sparse_moe``."""
        f = self.family
        if not layer.is_mtp:
            return f.block.format(index=layer.index)
        if f.mtp_block is None:
            return f.block.format(index=self.num_hidden_layers + layer.index)
        return f.mtp_block.format(index=layer.index)

    def expert(self, layer: "MoELayer", expert: int, proj: str, kind: str) -> str:
        f = self.family
        return f"{self.block(layer)}.experts.{expert}.{f.projections[proj]}.{f.kinds[kind]}"

    def shared_prefix(self, layer: "MoELayer") -> str:
        """Every checkpoint tensor of the layer's shared expert starts with this."""
        return f"{self.block(layer)}.shared_experts."

    def shared(self, layer: "MoELayer", proj: str, kind: str) -> str:
        return f"{self.shared_prefix(layer)}{self.family.projections[proj]}.{kind}"

    @cached_property
    def _patterns(self) -> list[tuple[re.Pattern[str], bool]]:
        """``(pattern of '<block>.experts.', is_mtp)`` for each block naming the family pre-bakes."""
        f = self.family
        blocks = [(f.block, False)] + ([(f.mtp_block, True)] if f.mtp_block is not None else [])
        out = []
        for template, is_mtp in blocks:
            head, _, tail = template.partition("{index}")
            out.append((re.compile(rf"^{re.escape(head)}(?P<index>{NUMBER}){re.escape(tail)}\.experts\."), is_mtp))
        return out

    def _layer_of(self, name: str) -> tuple["MoELayer", str] | None:
        from megamoe_convert.source.layers import MoELayer

        for pattern, is_mtp in self._patterns:
            m = pattern.match(name)
            if m:
                index = int(m["index"])
                if not is_mtp and self.family.mtp_block is None and index >= self.num_hidden_layers:
                    return MoELayer(True, index - self.num_hidden_layers), name[m.end():]
                return MoELayer(is_mtp, index), name[m.end():]
        return None

    def under_experts(self, name: str) -> bool:
        """Any tensor under a pre-baked layer's ``.experts.``, recognised or not."""
        return self._layer_of(name) is not None

    def parse_expert(self, name: str) -> tuple["MoELayer", int, str, str | None] | None:
        """``(layer, expert, proj, canonical kind)`` of a routed-expert tensor (kind ``None``: an
        unknown suffix); ``None`` when ``name`` is not under a pre-baked layer's experts or its
        tail is not ``E.wK.<suffix>``."""
        found = self._layer_of(name)
        if found is None:
            return None
        layer, tail = found
        projs = {name: proj for proj, name in self.family.projections.items()}
        m = re.fullmatch(rf"(?P<expert>{NUMBER})\.(?P<proj>{'|'.join(map(re.escape, projs))})\.(?P<suffix>\w+)", tail)
        if m is None:
            return None
        kinds = {suffix: kind for kind, suffix in self.family.kinds.items()}
        return layer, int(m["expert"]), projs[m["proj"]], kinds.get(m["suffix"])

    def _proj_pattern(self) -> str:
        """``w{1,2,3}``, or the family's own names: ``{gate_proj,down_proj,up_proj}``."""
        names = [self.family.projections[p] for p in PROJECTIONS]
        return "w{1,2,3}" if names == list(PROJECTIONS) else "{" + ",".join(names) + "}"

    def example(self) -> str:
        """A routed-expert weight's name pattern, for errors: ``layers.N.ffn.experts.E.w1.weight``."""
        proj = "wK" if self.family.projections["w1"] == "w1" else self.family.projections["w1"]
        return f"{self.family.block.format(index='N')}.experts.E.{proj}.{self.family.kinds['weight']}"

    def expected_pattern(self, kinds: Any) -> str:
        """How an error names the expected expert tensors: ``experts.{e}.w{1,2,3}.weight|scale``."""
        return f"experts.{{e}}.{self._proj_pattern()}.{'|'.join(sorted(self.family.kinds[k] for k in kinds))}"


DEEPSEEK_V4 = ModelFamily(
    name="deepseek_v4", title="DeepSeek-V4", model_types=("deepseek_v4",), text_key=None,
    keys={"hidden": "hidden_size", "intermediate": "moe_intermediate_size", "experts": "n_routed_experts",
          "top_k": "num_experts_per_tok", "layers": "num_hidden_layers", "mtp_layers": "num_nextn_predict_layers"},
    block="layers.{index}.ffn", mtp_block="mtp.{index}.ffn")

#: DeepSeek-V4.1: V4's tensor names and MoE modules; sizes under ``text_config``. Its ``mtp.*``
#: blocks are DSpark's draft, whose MoE layers have their own expert count (``dspark_n_routed_experts``:
#: vLLM's ``DeepseekV4MoE`` for a layer numbered after the decoder layers): pre-baked with that count.
DEEPSEEK_V41 = ModelFamily(
    name="deepseek_v41", title="DeepSeek-V4.1", model_types=("deepseek_v41",), text_key="text_config",
    keys={**DEEPSEEK_V4.keys, "mtp_experts": "dspark_n_routed_experts"},
    block="layers.{index}.ffn", mtp_block="mtp.{index}.ffn")

#: Kimi-K3: a latent MoE (the routed experts run at ``routed_expert_hidden_size``), compressed-tensors
#: MXFP4 names, the first ``first_k_dense_replace`` layers dense. vLLM's ``KimiMoE`` builds its
#: MegaMoE layers without redundant experts and never fuses the shared expert (it reads the
#: un-projected hidden state); SGLang's Kimi-K3 path rebuilds the experts itself (not served).
KIMI_K3 = ModelFamily(
    name="kimi_k3", title="Kimi-K3", model_types=("kimi_k3",), text_key="text_config",
    keys={"hidden": "routed_expert_hidden_size", "intermediate": "moe_intermediate_size", "experts": "num_experts",
          "top_k": "num_experts_per_token", "layers": "num_hidden_layers", "mtp_layers": "num_nextn_predict_layers"},
    block="language_model.model.layers.{index}.block_sparse_moe", mtp_block=None,
    kinds={"weight": "weight_packed", "scale": "weight_scale", "weight_scale_2": "weight_global_scale",
           "input_scale": "input_global_scale"},
    fuses_shared_expert=False, activation="situ", weight_formats=("mxfp4",),
    first_dense_key="first_k_dense_replace", freq_key="moe_layer_freq")

#: The Hugging Face naming of DeepSeek-V3, Qwen3-MoE and GLM-4.5: ``model.layers.L.mlp.experts.E.gate_proj``.
_HF_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_HF_KINDS = {"weight": "weight", "scale": "weight_scale_inv", "weight_scale_2": "weight_scale_2",
             "input_scale": "input_scale"}

#: DeepSeek-V3 / R1 (and V3.1): FP8 e4m3 experts with FP32 128x128 block scales (``weight_scale_inv``),
#: the first ``first_k_dense_replace`` layers dense, the MTP layer numbered after the decoder layers
#: (``model.layers.61``). SGLang's ``DeepseekV2MoE`` builds every MoE layer, NextN included, with
#: expert location and redundant experts; on Hopper its ``Fp8MoEMethod`` runs the SM90 FP8 MegaMoE.
DEEPSEEK_V3 = ModelFamily(
    name="deepseek_v3", title="DeepSeek-V3", model_types=("deepseek_v3",), text_key=None,
    keys={**DEEPSEEK_V4.keys},
    block="model.layers.{index}.mlp", mtp_block=None, kinds=_HF_KINDS, projections=_HF_PROJECTIONS,
    fuses_shared_expert=False, weight_formats=("fp8_block",),
    first_dense_key="first_k_dense_replace", freq_key="moe_layer_freq", sglang_mtp_like_decoder=True)

#: Qwen3-MoE (Qwen3-235B-A22B-FP8, Qwen3-30B-A3B-FP8): every layer MoE (as every release:
#: ``decoder_sparse_step`` 1, no ``mlp_only_layers``; a checkpoint with dense layers is refused by its
#: layer set), no shared expert, no MTP; SGLang's ``Qwen3MoeSparseMoeBlock`` runs MegaMoE.
QWEN3_MOE = ModelFamily(
    name="qwen3_moe", title="Qwen3-MoE", model_types=("qwen3_moe",), text_key=None,
    keys={"hidden": "hidden_size", "intermediate": "moe_intermediate_size", "experts": "num_experts",
          "top_k": "num_experts_per_tok", "layers": "num_hidden_layers", "mtp_layers": "num_nextn_predict_layers"},
    block="model.layers.{index}.mlp", mtp_block=None, kinds=_HF_KINDS, projections=_HF_PROJECTIONS,
    fuses_shared_expert=False, weight_formats=("fp8_block",))

#: GLM-4.5 / 4.6 (FP8 releases): DeepSeek-V3's naming and dense/MoE split, one MTP layer
#: (``model.layers.92``). Converted and verified, but served by no engine yet: SGLang 0.5.23's
#: ``Glm4MoeSparseMoeBlock`` never takes the MegaMoE forward.
GLM4_MOE = ModelFamily(
    name="glm4_moe", title="GLM-4.5", model_types=("glm4_moe",), text_key=None,
    keys={**DEEPSEEK_V4.keys},
    block="model.layers.{index}.mlp", mtp_block=None, kinds=_HF_KINDS, projections=_HF_PROJECTIONS,
    fuses_shared_expert=False, weight_formats=("fp8_block",),
    first_dense_key="first_k_dense_replace", sglang_mtp_like_decoder=True)

FAMILIES: tuple[ModelFamily, ...] = (DEEPSEEK_V4, DEEPSEEK_V41, KIMI_K3, DEEPSEEK_V3, QWEN3_MOE, GLM4_MOE)


def by_name(name: Any, where: object = "family") -> ModelFamily:
    """The family called ``name`` (a manifest's ``family``)."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise FamilyError(f"{where}: unknown model family {name!r} (known: {', '.join(f.name for f in FAMILIES)})")


def detect(config: Mapping[str, Any], where: object) -> ModelFamily:
    """The family of a checkpoint's ``config.json`` by its ``model_type`` (a config without one
    is DeepSeek-V4's flat layout, as every release so far); anything else is refused by name."""
    model_type = config.get("model_type")
    section = config.get("megamoe")
    if isinstance(section, dict) and section.get("converted_by") == "megamoe-convert":  # the marker of a conversion
        raise FamilyError(f"{where}: a megamoe-convert output's config.json, not a source checkpoint's: "
                          f"`megamoe inspect` of its folder says what it is and what to do with it")
    if model_type is None and "text_config" not in config:
        return DEEPSEEK_V4
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    archs = config.get("architectures")
    found = f"model_type {jsonio.short(model_type)}"
    if isinstance(archs, list):
        found += f" ({', '.join(map(str, archs))})"
    known = ", ".join(f"{f.title} ({'/'.join(f.model_types)})" for f in FAMILIES)
    raise FamilyError(f"{where}: {found} is no model family megamoe-convert converts (known: {known})")
