"""Every load format vLLM registers (read from its registry at test time, the plugin loaded) does
what ``engines/vllm/format_table.py`` says with a conversion, per-rank files and a store alike:

- ``SERVES``: vLLM's own loader for the format, on the plugin's subclass of vLLM's class, leaves the
  experts byte-equal to vLLM's own loading of the source;
- ``REFUSES``: vLLM's ``initialize_model`` (what every loader's ``load_model`` starts with), on vLLM's
  real ``ModelConfig`` and ``VllmConfig`` of the conversion, is refused in one line before vLLM's
  class builds anything;
- ``NO_LOCAL_FOLDER``: vLLM's loader refuses the source and the conversion with the same error, and
  no parameter changed;
- ``NO_WEIGHTS`` (``dummy``): the same random values as on the source, nothing installed;
- ``NEEDS_GPU``: what the CPU can check (the loader and the files it would read); the bytes are
  proven by ``benchmarks/gpu_load_formats.py`` on a GPU.
"""

from __future__ import annotations

import contextlib
import types
from unittest import mock

import pytest
import torch
import vllm_harness as h
from test_vllm_model_classes import (
    EP_SIZE,
    assert_experts,
    load,
    main_model,
    model_config,
    parent_load_weights,
    plugins,
)

from megamoe_convert.engines.format_matrix import Loads, table_problems
from megamoe_convert.engines.load_formats import INSTALLED_ATTR
from megamoe_convert.engines.vllm import weight_cache
from megamoe_convert.engines.vllm.format_table import FORMATS
from megamoe_convert.errors import InstallError

RANK = 3


def registered() -> list[str]:
    """Every load format vLLM's model-loader registry holds once the plugin registered its own."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    plugins()
    return sorted(_LOAD_FORMAT_TO_MODEL_LOADER)


REGISTERED = registered()


@pytest.fixture(scope="module", params=["per-rank", "store"])
def form(request, engine_ckpt):
    """A conversion of ``engine_ckpt`` for EP 4 with 4 redundant experts, and a store."""
    return request.getfixturevalue("engine_converted" if request.param == "per-rank" else "engine_store")


@pytest.fixture(scope="module")
def want(engine_ckpt):
    """Rank 3's experts as vLLM's own loading of the source leaves them (main model and MTP)."""
    from test_vllm_model_classes import reference

    with h.patched(RANK, EP_SIZE):
        return reference(engine_ckpt, RANK)


def test_every_registered_format_is_classified():
    assert REGISTERED == sorted(FORMATS), f"registered but not classified: {set(REGISTERED) - set(FORMATS)}; " \
                                          f"classified but not registered: {set(FORMATS) - set(REGISTERED)}"
    assert table_problems(FORMATS) == []


@pytest.mark.parametrize("load_format", REGISTERED)
def test_each_format_does_what_its_class_says(load_format, form, engine_ckpt, want, request):
    row = FORMATS.get(load_format)
    assert row is not None, f"--load-format {load_format}: registered by vLLM, not classified in format_table.py"
    {Loads.SERVES: serves, Loads.REFUSES: refuses, Loads.NO_LOCAL_FOLDER: no_local_folder,
     Loads.NO_WEIGHTS: no_weights, Loads.NEEDS_GPU: needs_gpu}[row.kind](load_format, form, engine_ckpt, want)


def serves(load_format, out, ckpt, want) -> None:
    config = model_config(out)
    seen: list[str] = []
    with h.patched(RANK, EP_SIZE):
        model = main_model(ckpt, RANK, config)
        with parent_load_weights(h.model_py.DeepseekV4ForCausalLM, seen):
            load(load_format, model, config)
        assert_experts(model, want)
    assert any(name.startswith("layers.0.attn.") for name in seen)  # the rest came from OUT's shards
    assert not any(".experts." in n and ".shared_experts." not in n for n in seen) and len(seen) == len(set(seen))


def vllm_config(out, load_format):
    """vLLM's real ``VllmConfig`` of ``out``, loading with ``load_format``."""
    from vllm.config import LoadConfig, ModelConfig, VllmConfig

    plugins()
    return VllmConfig(model_config=ModelConfig(model=str(out)), load_config=LoadConfig(load_format=load_format))


def refuses(load_format, out, ckpt, want) -> None:
    from vllm.model_executor.model_loader.utils import initialize_model

    config = vllm_config(out, load_format)
    built = mock.Mock(side_effect=AssertionError("vLLM's class was built"))
    with mock.patch.object(h.model_py.DeepseekV4ForCausalLM, "__init__", built), \
            pytest.raises(InstallError) as refused:
        initialize_model(vllm_config=config)
    line = str(refused.value)
    assert line.startswith(f"{out}: a megamoe-convert conversion cannot be served with vLLM's --load-format "
                           f"{load_format}: it {FORMATS[load_format].why}; ")
    assert line.endswith("serve it with --load-format megamoe (or auto)") and "\n" not in line
    assert not built.called


@contextlib.contextmanager
def one_process_parallel_state():
    """vLLM's tensor- and pipeline-parallel rank and groups, as one process serving alone has them
    (the sharded loaders read them to name the files they look for; no process group is made here)."""
    import vllm.distributed as dist

    alone = types.SimpleNamespace(world_size=1, rank_in_group=0)
    stand_ins = {"get_tensor_model_parallel_rank": lambda: 0, "get_pipeline_model_parallel_rank": lambda: 0,
                 "get_tensor_model_parallel_world_size": lambda: 1, "get_pp_group": lambda: alone,
                 "get_tp_group": lambda: alone}
    with contextlib.ExitStack() as stack:
        for name, stand_in in stand_ins.items():
            if hasattr(dist, name):
                stack.enter_context(mock.patch.object(dist, name, stand_in))
        yield


def no_local_folder(load_format, out, ckpt, want) -> None:
    from vllm.config import LoadConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    errors = []
    for path in (out, ckpt):
        config = model_config(path)
        with h.patched(RANK, EP_SIZE), one_process_parallel_state():
            model = main_model(ckpt, RANK, config)
            before = [p.clone() for p in model.parameters()]
            with set_current_vllm_config(VllmConfig()), pytest.raises(Exception) as refused:
                get_model_loader(LoadConfig(load_format=load_format)).load_weights(model, config)
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
            assert not hasattr(model, INSTALLED_ATTR)
        errors.append((type(refused.value), str(refused.value).replace(str(path), "PATH")))
    assert errors[0] == errors[1] and not isinstance(refused.value, (InstallError, AssertionError)), errors


def no_weights(load_format, out, ckpt, want) -> None:
    """``dummy``: vLLM's seeded random values, the same as on the source; the model is fed no weight
    (its ``load_weights`` is never called), no expert installed."""
    values = []
    for path in (out, ckpt):
        config = model_config(path)
        with h.patched(RANK, EP_SIZE):
            model = main_model(ckpt, RANK, config)
            reads = mock.Mock(side_effect=AssertionError("load_weights was fed weights"))
            with mock.patch.object(type(model), "load_weights", reads):
                load(load_format, model, config)
            assert not reads.called and not hasattr(model, INSTALLED_ATTR)
            values.append({name: p.clone() for name, p in model.named_parameters()})
    assert values[0] and values[0].keys() == values[1].keys()
    for name, tensor in values[0].items():
        assert torch.equal(tensor, values[1][name]), f"{name}: dummy values differ on the conversion"


def needs_gpu(load_format, out, ckpt, want) -> None:
    """What the CPU can check of a format whose package or transport needs a GPU."""
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import DefaultModelLoader, get_model_loader

    assert FORMATS[load_format].on_gpu is Loads.SERVES
    if load_format == "ipc_cache":  # the plugin's IpcModelLoader, whose disk fallback is --load-format megamoe
        loader = get_model_loader(LoadConfig(load_format=load_format))
        assert getattr(type(loader), "megamoe", False) and weight_cache._fallback_format(str(out)) == "megamoe"
        return
    if load_format in ("fastsafetensors", "instanttensor"):  # vLLM's default loader: the model's load_weights
        loader = get_model_loader(LoadConfig(load_format=load_format))
        assert type(loader) is DefaultModelLoader
        plain = get_model_loader(LoadConfig(load_format="safetensors"))
        files = [sorted(ld._prepare_weights(str(out), None, None, False, None)[1]) for ld in (loader, plain)]
        assert files[0] == files[1] and files[0] and all(f.count("/") == str(out).count("/") + 1 for f in files[0])
        return
    from vllm.model_executor.model_loader import RunaiModelStreamerLoader

    assert load_format == "runai_streamer"  # its package is on the GPU run's path only
    assert type(get_model_loader(LoadConfig(load_format=load_format))) is RunaiModelStreamerLoader


def test_the_gpu_formats_run_serves_through_the_same_path_on_the_cpu(tmp_path, capsys):
    """``benchmarks/gpu_load_formats.py --smoke``: the GPU proof's own path (its checkpoint and
    conversions, :func:`serves`) with ``safetensors`` on the CPU; on a GPU it runs the NEEDS_GPU formats."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_load_formats.py"
    spec = importlib.util.spec_from_file_location("gpu_load_formats", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert sorted(script.gpu_formats()) == ["fastsafetensors", "instanttensor", "runai_streamer"]
    assert script.main(["--smoke", "--work", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("safetensors ")] == \
        ["safetensors per-rank", "safetensors store"]
    assert all("byte-equal" in line for line in lines if line.startswith("safetensors "))
