"""Kimi-K3 and DeepSeek-V4.1 checkpoints end to end against vLLM 0.33's real model code: what
``install`` and ``--load-format megamoe`` leave in each model's MegaMoE modules (and in their
drafts': ``KimiK3MTP``, V4.1's DSpark ``DSparkDeepseekV4ForCausalLM``) is byte for byte what
vLLM's own loading of the source checkpoint leaves (iterator, the model's ``hf_to_vllm_mapper``
and ``load_weights``, the experts' ``weight_loader`` / ``load_shared_expert_weight``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm_harness as vh

from megamoe_convert.convert.plan import ConvertOptions
from megamoe_convert.convert.run import convert
from megamoe_convert.engines.vllm import install
from megamoe_convert.errors import InstallError
from megamoe_convert.synth.write import synthesize

if vh.KERNEL_LAYOUT:  # Kimi-K3 and V4.1 exist from vLLM 0.33 on; elsewhere every test here is deselected
    import models_harness as mh
    from test_vllm_load_format import load, megamoe_loader

pytestmark = pytest.mark.only_kernel_layout

EP_SIZE = 4


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The kimi-k3-tiny preset (MoE layers 1-2 of 3, 8 experts), converted for EP 4 (no redundant
    experts: Kimi-K3's MegaMoE layers have none)."""
    root = tmp_path_factory.mktemp("kimi")
    synthesize(root / "ckpt", "kimi-k3-tiny", seed=11)
    convert(root / "ckpt", root / "ep4", ConvertOptions(ep_size=EP_SIZE, fsync=False))
    return root / "ckpt", root / "ep4"


@pytest.fixture(scope="module")
def v41(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The v4.1-tiny preset (2 layers, 8 experts, 32x32 FP8 shared experts, one DSpark MTP block),
    converted for EP 4 with 4 redundant experts."""
    root = tmp_path_factory.mktemp("v41")
    synthesize(root / "ckpt", "v4.1-tiny", seed=12)
    convert(root / "ckpt", root / "ep4", ConvertOptions(ep_size=EP_SIZE, num_redundant_experts=4, fsync=False))
    return root / "ckpt", root / "ep4"


def assert_same_module(got, want, where: str) -> None:
    """Every parameter (routed and fused shared), what the kernel and EPLB read: same bytes,
    dtypes, shapes and strides."""
    g, w = dict(got.named_parameters()), dict(want.named_parameters())
    assert sorted(g) == sorted(w), where
    vh.assert_same_tensors(list(g.values()), [w[n] for n in g], f"{where} parameters")
    vh.assert_same_tensors(vh.kernel_view(got), vh.kernel_view(want), f"{where} kernel")
    vh.assert_same_tensors(got.get_expert_weights(), want.get_expert_weights(), f"{where} EPLB")


def params_of(model) -> dict[str, dict[str, torch.nn.Parameter]]:
    return {p: dict(m.named_parameters()) for p, m in mh.experts_of(model).items()}


# --------------------------------------------------------------------------------------
# Kimi-K3
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("rank", range(EP_SIZE))
def test_kimi_k3_install_gives_what_vllms_own_kimi_loading_gives(kimi, rank):
    ckpt, out = kimi
    config = mh.kimi_config(ckpt)
    with mh.patched(rank, EP_SIZE):
        reference = mh.build_kimi(config, rank, EP_SIZE)
        loaded = reference.load_weights(mh.weights(ckpt))
        model = mh.build_kimi(config, rank, EP_SIZE)
        before = params_of(model)
        assert install(model, out, rank=rank) == 2
    assert len(loaded) == 8  # w13/w2 weight and scale of both MoE layers reached vLLM's params
    want, got = mh.experts_of(reference), mh.experts_of(model)
    assert sorted(got) == [f"language_model.model.layers.{i}.block_sparse_moe.experts" for i in (1, 2)]
    for prefix, module in got.items():
        assert torch.count_nonzero(module.w13_weight_scale) > 0
        assert_same_module(module, want[prefix], prefix)
        for name, param in module.named_parameters():  # the very Parameters vLLM registered
            assert param is before[prefix][name]
            assert param.weight_loader.__func__ is type(module).weight_loader


def test_kimi_k3_load_format_installs_the_experts_and_feeds_vllm_everything_else(kimi):
    ckpt, out = kimi
    config = mh.kimi_config(ckpt)
    with mh.patched(2, EP_SIZE):
        reference = mh.build_kimi(config, 2, EP_SIZE)
        reference.load_weights(mh.weights(ckpt))
        model = mh.build_kimi(config, 2, EP_SIZE)
        seen: list[str] = []
        model.load_weights = lambda weights: seen.extend(name for name, _ in weights) or set()
        load(megamoe_loader(), model, out)
    for prefix, module in mh.experts_of(model).items():
        assert_same_module(module, mh.experts_of(reference)[prefix], prefix)
    assert not [n for n in seen if ".experts." in n and ".shared_experts." not in n]
    for name in ("language_model.model.layers.0.mlp.gate_proj.weight",
                 "language_model.model.layers.1.block_sparse_moe.shared_experts.down_proj.weight",
                 "language_model.model.layers.1.block_sparse_moe.routed_expert_down_proj.weight",
                 "vision_tower.patch_embed.proj.weight"):
        assert name in seen, name


def test_a_kimi_k3_model_built_for_another_ep_size_is_refused_before_any_change(kimi):
    ckpt, out = kimi
    config = mh.kimi_config(ckpt)
    with mh.patched(0, 2):
        model = mh.build_kimi(config, 0, 2)
        with pytest.raises(InstallError, match=r"block_sparse_moe\.experts: num_local_experts is 4 in the model but 2"):
            install(model, out, rank=0)
        assert all(torch.count_nonzero(p) == 0 for p in model.parameters())


def test_kimi_k3_mtp_blocks_numbered_after_the_decoder_layers_install_into_kimi_k3_mtp(tmp_path):
    """Kimi-K3 ships no MTP block, but vLLM has its draft (``KimiK3MTP``): a checkpoint with one
    (``language_model.model.layers.{N}``) converts to ``mtp.0`` and installs what its own loading gives."""
    synthesize(tmp_path / "ckpt", "kimi-k3-tiny", mtp_layers=1, seed=13)
    convert(tmp_path / "ckpt", tmp_path / "ep4", ConvertOptions(ep_size=EP_SIZE, fsync=False))
    config = mh.kimi_config(tmp_path / "ckpt")
    with mh.patched(3, EP_SIZE):
        reference = mh.build_kimi_mtp(config, 3, EP_SIZE)
        reference.load_weights(mh.weights(tmp_path / "ckpt"))
        mtp = mh.build_kimi_mtp(config, 3, EP_SIZE)
        assert install(mtp, tmp_path / "ep4", rank=3) == 1
        main = mh.build_kimi(config, 3, EP_SIZE)
        assert install(main, tmp_path / "ep4", rank=3) == 2  # the main model skips the MTP block's experts
    (prefix, module), = mh.experts_of(mtp).items()
    assert prefix == "model.layers.3.block_sparse_moe.experts"
    assert torch.count_nonzero(module.w2_weight) > 0
    assert_same_module(module, mh.experts_of(reference)[prefix], prefix)


# --------------------------------------------------------------------------------------
# DeepSeek-V4.1
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("rank", [0, 3])
@pytest.mark.parametrize("fuse_shared", [True, False], ids=["fused-shared-expert", "shared-expert-apart"])
def test_deepseek_v41_install_gives_what_vllms_own_v41_loading_gives(v41, rank, fuse_shared):
    ckpt, out = v41
    config = mh.v41_config(ckpt)
    with mh.patched(rank, EP_SIZE):
        reference = mh.build_v41(config, rank, EP_SIZE, 4, fuse_shared)
        reference.load_weights(mh.weights(ckpt, shared=fuse_shared))
        model = mh.build_v41(config, rank, EP_SIZE, 4, fuse_shared)
        before = params_of(model)
        assert install(model, out, rank=rank) == 2
    want, got = mh.experts_of(reference), mh.experts_of(model)
    assert sorted(got) == [f"language_model.model.layers.{i}.ffn.experts" for i in (0, 1)]
    for prefix, module in got.items():
        assert module.has_fused_shared_experts == fuse_shared
        if fuse_shared:
            assert torch.count_nonzero(module.shared_l2_weight_scale) > 0
        assert_same_module(module, want[prefix], prefix)
        for name, param in module.named_parameters():
            assert param is before[prefix][name]


def test_deepseek_v41_load_format_leaves_vllm_only_what_was_not_installed(v41):
    ckpt, out = v41
    config = mh.v41_config(ckpt)
    with mh.patched(1, EP_SIZE):
        reference = mh.build_v41(config, 1, EP_SIZE, 4)
        reference.load_weights(mh.weights(ckpt, shared=True))
        model = mh.build_v41(config, 1, EP_SIZE, 4)
        seen: list[str] = []
        model.load_weights = lambda weights: seen.extend(name for name, _ in weights) or set()
        load(megamoe_loader(), model, out)
    for prefix, module in mh.experts_of(model).items():
        assert_same_module(module, mh.experts_of(reference)[prefix], prefix)
    assert not [n for n in seen if n.startswith("layers.") and ".experts." in n]  # routed and fused shared: installed
    assert "layers.0.attn.wq_a.weight" in seen and "mtp.0.ffn.shared_experts.w1.weight" in seen


@pytest.mark.parametrize("rank", [0, 1, 3])
@pytest.mark.parametrize("fuse_shared", [True, False], ids=["fused-shared-expert", "shared-expert-apart"])
def test_the_deepseek_v41_dspark_draft_installs_what_its_own_loading_gives(v41, rank, fuse_shared):
    """V4.1's MTP block is DSpark's draft with its own 4 experts (top-2) plus the target's 4
    redundant slots: 2 per rank, slot p holding p % 4. ``install`` into the real
    ``DSparkDeepseekV4ForCausalLM`` gives what its own ``load_weights`` gives; the target model
    skips the draft's layer."""
    ckpt, out = v41
    config = mh.v41_config(ckpt)
    with mh.patched(rank, EP_SIZE):
        reference = mh.build_v41_dspark(config, rank, EP_SIZE, 4, fuse_shared)
        loaded = reference.load_weights(mh.weights(ckpt, shared=fuse_shared))
        draft = mh.build_v41_dspark(config, rank, EP_SIZE, 4, fuse_shared)
        before = params_of(draft)
        assert install(draft, out, rank=rank) == 1
        assert install(mh.build_v41(config, rank, EP_SIZE, 4, fuse_shared), out, rank=rank) == 2
    assert len([n for n in loaded if ".experts.w" in n]) == 4  # w13/w2 weight and scale reached vLLM's params
    (prefix, module), = mh.experts_of(draft).items()
    assert prefix == "model.layers.2.ffn.experts"
    assert (module.num_experts, module.num_local_experts, module.num_logical_experts) == (8, 2, 4)
    assert module.has_fused_shared_experts == fuse_shared
    assert torch.count_nonzero(module.w13_weight_scale) > 0
    if fuse_shared:
        assert torch.count_nonzero(module.shared_l2_weight_scale) > 0
    assert_same_module(module, mh.experts_of(reference)[prefix], prefix)
    for name, param in module.named_parameters():
        assert param is before[prefix][name]


def test_a_dspark_draft_built_for_another_ep_size_is_refused_before_any_change(v41):
    """The draft's numbers are checked against the MTP layer's own placement (4 + 4 slots over EP 2:
    4 per rank, not the decoder's 6)."""
    ckpt, out = v41
    config = mh.v41_config(ckpt)
    with mh.patched(0, 2):
        draft = mh.build_v41_dspark(config, 0, 2, 4)
        with pytest.raises(InstallError, match=r"model\.layers\.2\.ffn\.experts: num_local_experts is 4 in the "
                                               r"model but 2 in"):
            install(draft, out, rank=0)
        assert all(torch.count_nonzero(p) == 0 for p in draft.parameters())


def test_the_dspark_draft_load_format_installs_its_experts_and_feeds_it_everything_else(v41):
    """``--load-format megamoe`` on the draft: its MoE layer comes from the rank files (routed and
    fused shared experts), its own ``load_weights`` gets the rest of ``mtp.*``."""
    ckpt, out = v41
    config = mh.v41_config(ckpt)
    with mh.patched(2, EP_SIZE):
        reference = mh.build_v41_dspark(config, 2, EP_SIZE, 4, True)
        reference.load_weights(mh.weights(ckpt, shared=True))
        draft = mh.build_v41_dspark(config, 2, EP_SIZE, 4, True)
        seen: list[str] = []
        draft.load_weights = lambda weights: seen.extend(name for name, _ in weights) or set()
        load(megamoe_loader(), draft, out)
    (prefix, module), = mh.experts_of(draft).items()
    assert_same_module(module, mh.experts_of(reference)[prefix], prefix)
    assert not [n for n in seen if n.startswith("mtp.0.ffn.") and ".experts." in n]  # routed and fused shared
    assert "mtp.0.ffn.gate.weight" in seen and "mtp.0.attn.wkv.weight" in seen
