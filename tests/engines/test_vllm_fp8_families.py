"""vLLM and SGLang's Hopper FP8 MegaMoE families (DeepSeek-V3/R1, Qwen3-MoE): vLLM runs no MegaMoE for
them, so with megamoe-convert installed its own config reading refuses their conversions and stores
in one line naming why, before any model is built (it would build the family's own modules and serve
them without experts)."""

from __future__ import annotations

import functools
from unittest import mock

import pytest

from megamoe_convert.convert import ConvertOptions, convert
from megamoe_convert.errors import InstallError
from megamoe_convert.synth.write import synthesize


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out = {}
    for preset in ("deepseek-v3-tiny", "qwen3-moe-tiny"):
        root = tmp_path_factory.mktemp(preset)
        synthesize(root / "ckpt", preset, seed=6)
        convert(root / "ckpt", root / "ep2", ConvertOptions(ep_size=2, engine="sglang"))
        convert(root / "ckpt", root / "store", ConvertOptions(ep_size=None))
        out[preset] = root
    return out


def parsed(path):
    """vLLM's own ``get_config`` (the ``hf`` parser, as megamoe-convert's plugin leaves it); its retry of
    a failed parse (for a hub cache being refreshed) calls the parser once more, without the seconds'
    wait before it."""
    from vllm.plugins import load_general_plugins
    from vllm.transformers_utils import config
    from vllm.transformers_utils.repo_utils import with_retry

    load_general_plugins()
    no_wait = functools.partial(with_retry, retry_delay=0)
    with mock.patch.object(config, "with_retry", no_wait):
        return config.get_config(str(path), trust_remote_code=False)


@pytest.mark.parametrize("form", ["ep2", "store"])
@pytest.mark.parametrize("preset,title", [("deepseek-v3-tiny", "DeepSeek-V3"), ("qwen3-moe-tiny", "Qwen3-MoE")])
def test_vllm_refuses_a_conversion_of_a_family_it_runs_no_megamoe_for(outputs, preset, title, form):
    with pytest.raises(InstallError, match=f"a megamoe-convert conversion of {title}, which vLLM cannot serve: "
                                           "vLLM 0.30-0.33 runs MegaMoE for DeepSeek-V4, DeepSeek-V4.1 and Kimi-K3 "
                                           "only") as info:
        parsed(outputs[preset] / form)
    assert "\n" not in str(info.value)
    source = parsed(outputs[preset] / "ckpt")  # the source itself is vLLM's to serve as it always was
    assert source.model_type == preset.removesuffix("-tiny").replace("-", "_")
