"""Every load format SGLang knows (its ``LoadFormat`` enum and ``--load-format`` choices, read at test
time with the plugin loaded) does what ``engines/sglang/format_table.py`` says with a conversion,
per-rank files and a store alike:

- ``SERVES``: SGLang's own loader for the format feeds the hooked ``load_weights`` of SGLang's class
  and post-processes: the experts are byte-equal to SGLang's own loading of the source;
- ``REFUSES``: SGLang's ``get_model_loader`` (where the model runner and ``get_model`` start), on the
  config SGLang's own ``get_config`` read off the conversion, is refused in one line before any
  loader or model is built;
- ``NO_LOCAL_FOLDER``: SGLang's loader refuses the source and the conversion with the same error,
  and no parameter changed;
- ``NO_WEIGHTS`` (``dummy``): the same random values as on the source, nothing installed;
- ``NEEDS_GPU``: what the CPU can check (the loader and the files it would read); the bytes are
  proven by ``benchmarks/gpu_load_formats.py`` on a GPU.
"""

from __future__ import annotations

import types
from unittest import mock

import pytest
import sglang_harness as h
import torch
from sglang_model_classes_harness import hooked_load_weights, load, parsed, plugins, tree_config
from test_sglang_model_classes import EP_SIZE, REDUNDANT, assert_experts, reference

from megamoe_convert.engines.format_matrix import Loads, table_problems
from megamoe_convert.engines.load_formats import INSTALLED_ATTR
from megamoe_convert.engines.sglang import hooks, model_classes
from megamoe_convert.engines.sglang.format_table import FORMATS
from megamoe_convert.errors import InstallError

RANK = 3


def registered() -> list[str]:
    """Every load format SGLang's ``LoadConfig`` accepts, and every ``--load-format`` choice, once
    the plugin added its own."""
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES
    from sglang.srt.configs.load_config import LoadFormat

    plugins()
    return sorted({f.value for f in LoadFormat} | set(LOAD_FORMAT_CHOICES))


REGISTERED = registered()


@pytest.fixture(scope="module", params=["per-rank", "store"])
def form(request, sglang_ckpt):
    """``sglang_ckpt`` converted for SGLang (EP 4, 4 redundant experts), and as a store."""
    return request.getfixturevalue("sglang_converted" if request.param == "per-rank" else "sglang_store")


@pytest.fixture(scope="module")
def want(sglang_ckpt):
    """Rank 3's experts as SGLang's own loading of the source leaves them (main model and NextN)."""
    with h.patched(RANK, EP_SIZE, REDUNDANT):
        return reference(sglang_ckpt, RANK)


def model_config(out):
    """What SGLang's loaders read of its ``ModelConfig``, with the config SGLang's own (hooked)
    ``get_config`` read off ``out``."""
    from sglang.srt.configs.model_config import ModelImpl

    config = parsed(out)
    return types.SimpleNamespace(model_path=str(out), revision=None, hf_config=config, hf_text_config=config,
                                 quantization=None, dtype=torch.bfloat16, modelopt_quant=None, is_multimodal=False,
                                 is_generation=True, model_impl=ModelImpl.AUTO)


def test_every_format_sglang_knows_is_classified():
    assert REGISTERED == sorted(FORMATS), f"known to SGLang but not classified: {set(REGISTERED) - set(FORMATS)}; " \
                                          f"classified but unknown: {set(FORMATS) - set(REGISTERED)}"
    assert table_problems(FORMATS) == []


def test_the_model_runners_binding_of_get_model_loader_is_the_hooked_one():
    from sglang.srt.model_executor.model_runner_components import load_model_utils
    from sglang.srt.model_loader import loader

    plugins()
    for module in (loader, load_model_utils):
        assert getattr(module.get_model_loader, "__wrapped__", None) is not None, module.__name__


@pytest.mark.parametrize("load_format", REGISTERED)
def test_each_format_does_what_its_class_says(load_format, form, sglang_ckpt, want):
    row = FORMATS.get(load_format)
    assert row is not None, f"--load-format {load_format}: known to SGLang, not classified in format_table.py"
    {Loads.SERVES: serves, Loads.REFUSES: refuses, Loads.NO_LOCAL_FOLDER: no_local_folder,
     Loads.NO_WEIGHTS: no_weights, Loads.NEEDS_GPU: needs_gpu}[row.kind](load_format, form, sglang_ckpt, want)


def serves(load_format, out, ckpt, want) -> None:
    seen: list[str] = []
    with h.patched(RANK, EP_SIZE, REDUNDANT):
        config = tree_config(ckpt, out)
        model = h.build_main_model(config, RANK, REDUNDANT)
        with hooked_load_weights(h.DeepseekV4ForCausalLM, seen):
            load(load_format, model, out, config)  # SGLang's post-processing runs here too
        assert_experts(model, want)
    assert any(name.startswith("layers.0.attn.") for name in seen)
    assert not any(".experts." in n and ".shared_experts." not in n for n in seen) and len(seen) == len(set(seen))


def serves_through_load_model(load_format, out, ckpt, want, device: str = "cpu") -> None:
    """:func:`serves`, from SGLang's ``get_model_loader`` to the end of the loader's own ``load_model``
    (the harness's model standing in for ``_initialize_model``): the path of a loader with no
    ``load_weights_and_postprocess`` of its own (``runai_streamer``), on ``device``."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader import loader

    seen: list[str] = []
    with h.patched(RANK, EP_SIZE, REDUNDANT):
        config = model_config(out)
        model = h.build_main_model(tree_config(ckpt, out), RANK, REDUNDANT)
        with built(model), hooked_load_weights(h.DeepseekV4ForCausalLM, seen):
            engine_loader = loader.get_model_loader(LoadConfig(load_format=load_format), config)
            engine_loader.load_model(model_config=config, device_config=DeviceConfig(device, gpu_id=0))
        assert_experts(model, want)
    assert any(name.startswith("layers.0.attn.") for name in seen)
    assert not any(".experts." in n and ".shared_experts." not in n for n in seen) and len(seen) == len(set(seen))


def refuses(load_format, out, ckpt, want) -> None:
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_executor.model_runner_components import load_model_utils
    from sglang.srt.model_loader import loader

    config = model_config(out)
    building = mock.Mock(side_effect=AssertionError("a model was built"))
    with mock.patch.object(loader, "_initialize_model", building), pytest.raises(InstallError) as refused:
        load_model_utils.get_model_loader(load_config=LoadConfig(load_format=load_format), model_config=config)
    line = str(refused.value)
    assert line.startswith(f"{out}: a megamoe-convert conversion cannot be served with SGLang's --load-format "
                           f"{load_format}: it {FORMATS[load_format].why}; ")
    assert line.endswith("serve it with --load-format megamoe (or auto)") and "\n" not in line
    assert not building.called


def built(model):
    """SGLang's ``_initialize_model``, building ``model``: the harness's tree of SGLang's class (its
    whole model needs a GPU attention backend)."""
    return mock.patch("sglang.srt.model_loader.loader._initialize_model", lambda *args, **kwargs: model)


def engine_load_model(load_format, path, ckpt):
    """SGLang's loader for ``load_format`` from ``get_model_loader`` to the end of its ``load_model``
    on ``path``: the model, what was raised (or None), and whether the model's ``load_weights`` (the
    one way to a checkpoint's tensors, hooked by the plugin) was called."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader import loader

    config = model_config(path)
    with h.patched(RANK, EP_SIZE, REDUNDANT):
        model = h.build_main_model(tree_config(ckpt, path), RANK, REDUNDANT)
        reads = mock.Mock(side_effect=AssertionError("load_weights was fed weights"))
        raised = None
        fed = hooks.wrap_around(reads, model_classes.load_weights_around)  # hooked, as the plugin leaves it
        with built(model), mock.patch.object(type(model), "load_weights", fed):
            try:
                engine_loader = loader.get_model_loader(LoadConfig(load_format=load_format), config)
                engine_loader.load_model(model_config=config, device_config=DeviceConfig("cpu"))
            except Exception as e:  # what SGLang raises is compared, source against conversion
                raised = e
    assert not reads.called and not hasattr(model, INSTALLED_ATTR)
    return model, raised


def no_local_folder(load_format, out, ckpt, want) -> None:
    """SGLang refuses the conversion as it refuses the source, with the same error, before it feeds
    the model a weight; nothing installed."""
    errors = []
    for path in (out, ckpt):
        _, raised = engine_load_model(load_format, path, ckpt)
        assert raised is not None and not isinstance(raised, (InstallError, AssertionError)), raised
        errors.append((type(raised), str(raised).replace(str(path), "PATH")))
    assert errors[0] == errors[1], errors


def no_weights(load_format, out, ckpt, want) -> None:
    """``dummy``: SGLang's random values (``initialize_dummy_weights``) on the conversion as on the
    source; the model is fed no weight, no expert installed."""
    from sglang.srt.model_loader import loader

    for path in (out, ckpt):
        with mock.patch.object(loader, "initialize_dummy_weights", wraps=loader.initialize_dummy_weights) as dummy:
            model, raised = engine_load_model(load_format, path, ckpt)
        assert raised is None and dummy.call_count == 1 and dummy.call_args.args[0] is model


def needs_gpu(load_format, out, ckpt, want) -> None:
    """What the CPU can check of a format whose package or transport needs a GPU."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader import loader

    assert FORMATS[load_format].on_gpu is Loads.SERVES
    config = model_config(out)
    if load_format == "ipc_cache":  # the disk fallback loads with the format it replaced: one that serves
        load_config = LoadConfig(load_format="auto")
        load_config.fallback_load_format, load_config.load_format = load_config.load_format, load_format
        engine_loader = loader.get_model_loader(load_config, config)
        assert type(engine_loader).__name__ == "IpcModelLoader"
        assert FORMATS[str(load_config.fallback_load_format.value)].kind is Loads.SERVES
        return
    engine_loader = loader.get_model_loader(LoadConfig(load_format=load_format), config)
    if load_format in ("fastsafetensors", "instanttensor"):  # SGLang's default loader: the model's load_weights
        assert type(engine_loader) is loader.DefaultModelLoader
        plain = loader.get_model_loader(LoadConfig(load_format="safetensors"), config)
        with h.patched(RANK, EP_SIZE, REDUNDANT):  # SGLang's server args, which its file listing reads
            files = [sorted(ld._prepare_weights(str(out), None, False)[1]) for ld in (engine_loader, plain)]
        assert files[0] == files[1] and files[0] and all(f.count("/") == str(out).count("/") + 1 for f in files[0])
        return
    assert load_format == "runai_streamer"  # its package is on the GPU run's path only
    assert type(engine_loader) is loader.RunaiModelStreamerLoader


def test_the_gpu_formats_run_serves_through_the_same_path_on_the_cpu(tmp_path, capsys):
    """``benchmarks/gpu_load_formats.py --engine sglang --smoke``: the GPU proof's own path (its
    checkpoint and conversions, :func:`serves_through_load_model`) with ``safetensors`` on the CPU."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_load_formats.py"
    spec = importlib.util.spec_from_file_location("gpu_load_formats", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert sorted(script.gpu_formats("sglang")) == ["fastsafetensors", "instanttensor", "runai_streamer"]
    assert script.main(["--engine", "sglang", "--smoke", "--work", str(tmp_path)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("safetensors ")]
    assert [line.split(":")[0] for line in lines] == ["safetensors per-rank", "safetensors store"]
    assert all("byte-equal" in line for line in lines)
