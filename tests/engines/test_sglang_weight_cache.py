"""SGLang 0.5.23's weight-cache daemon serving a conversion (``megamoe preload``, ``--weight-cache-mode
client``), with SGLang's own ``weight_cache`` code on the CPU.

Real here: SGLang's ``WeightCacheDaemon`` (its export, its Unix-socket server and its answer to an
engine), its torch-IPC transport (on the CPU, torch shares tensors through shared memory, as it
shares CUDA memory through IPC handles on a GPU), its ``IpcModelLoader`` (the model built on
``meta``, SGLang's shape check, the mapping), its server-args parsing and daemon launcher. The
daemon's ``load`` body needs a CUDA device and process groups: its model is loaded by SGLang's
``DefaultModelLoader`` (through the plugin's hooked ``load_weights``), inside the plugin's own hook
around ``load``. The model's constructor is the harness's tree of SGLang's own classes, as
everywhere in these tests. CUDA IPC itself, between two processes, runs in ``gpu_sglang_weight_cache.py``
(its CPU run is the last test here).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import threading
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from unittest import mock

import pytest
import sglang_harness as h
import torch
from cli_runs import run_cli
from sglang.srt.layers.moe import mega_moe
from sglang.srt.weight_cache import daemon as daemon_py  # noqa: F401 (imported outside any patch.dict of
from sglang.srt.weight_cache import ipc_loader  # noqa: F401  sys.modules, so the plugin's hooks stay on them)
from sglang_model_classes_harness import hooked_load_weights, plugins, tree_config
from test_sglang_layout_probe import _interleaved_by_16
from test_sglang_model_classes import assert_experts, reference

from megamoe_convert.engines import probe
from megamoe_convert.engines.sglang import preload, weight_cache
from megamoe_convert.errors import InstallError

EP_SIZE, REDUNDANT = 4, 4


#: Each test probes the engine afresh (tests/engines/conftest.py).
pytestmark = pytest.mark.usefixtures("probes_afresh")


@pytest.fixture
def sockets(monkeypatch) -> Iterator[Path]:
    """SGLang's socket and ready-file templates in a short folder (AF_UNIX paths fit 108 bytes), each
    named by the device's UUID (a GPU's: the CPU has none here)."""
    from sglang.srt.platforms import current_platform

    monkeypatch.setattr(current_platform, "get_device_uuid", lambda device_id=0: f"gpu{device_id}")
    folder = Path(tempfile.mkdtemp(prefix="swc", dir="/tmp"))
    monkeypatch.setenv("SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE", f"{folder}/{{device_uuid}}.sock")
    monkeypatch.setenv("SGLANG_WEIGHT_CACHE_READY_TEMPLATE", f"{folder}/{{device_uuid}}.ready")
    yield folder
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()


def model_config(out: Path, config) -> types.SimpleNamespace:
    return types.SimpleNamespace(model_path=str(out), revision=None, hf_config=config, is_draft_model=False,
                                 quantization=None, dtype=torch.bfloat16)


@contextmanager
def built_as_tree(rank: int) -> Iterator[None]:
    """SGLang's loaders building the harness's tree (the IPC loader's on ``meta``)."""
    from sglang.srt.model_loader import loader

    def initialize(model_config, load_config, quant_config=None):
        return h.build_on_any_device(model_config.hf_config, rank, REDUNDANT)

    with mock.patch.object(loader, "_initialize_model", initialize), \
            mock.patch.object(ipc_loader, "_initialize_model", initialize), \
            mock.patch.object(loader, "_get_quantization_config", lambda *_: h.quant_config()):
        yield


def cache_config(out: Path, config, rank: int):
    """The daemon's fingerprint of what it loaded: what the engine's ``IpcModelLoader`` sends for the same rank."""
    from sglang.srt.runtime_context import get_exec, get_parallel
    from sglang.srt.weight_cache.protocol import CacheConfig, compute_env_stamp

    p = get_parallel()
    assert p.moe_ep_rank == rank
    return CacheConfig(model_path=str(out), model_arch=config.architectures[0], tp_size=p.tp_size, tp_rank=p.tp_rank,
                       pp_size=p.pp_size, pp_rank=p.pp_rank, dp_size=p.dp_size, ep_size=p.moe_ep_size,
                       moe_dp_size=p.moe_dp_size, moe_dp_rank=p.moe_dp_rank, moe_ep_rank=p.moe_ep_rank,
                       attn_dp_size=p.attn_dp_size, enable_dp_lm_head=p.enable_dp_lm_head,
                       attn_cp_size=p.attn_cp_size, moe_dense_tp_size=p.moe_dense_tp_size,
                       moe_a2a_backend=get_exec().moe.moe_a2a_backend, quant_method="", quant_config_hash="",
                       dtype=str(torch.bfloat16), revision="", **compute_env_stamp())


@contextmanager
def daemon_up(out: Path, ckpt: Path, rank: int, args, device: str = "cpu") -> Iterator[object]:
    """A daemon of ``out``'s rank on a real socket: SGLang's ``WeightCacheDaemon``, its model loaded by
    SGLang's default loader inside the plugin's hook around ``load``, then its own export and server."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import get_model_loader
    from sglang.srt.weight_cache.daemon import WeightCacheDaemon

    plugins()
    assert getattr(WeightCacheDaemon.load, "__wrapped__", None) is not None  # hooked by load_plugins
    daemon = WeightCacheDaemon(server_args=args, gpu_id=0, tp_rank=rank, pp_rank=0)
    daemon.model_path = str(out)
    config = tree_config(ckpt, out)

    def load(d) -> None:
        loader = get_model_loader(LoadConfig(load_format="auto"))
        d.model = loader.load_model(model_config=model_config(out, config), device_config=DeviceConfig(device, 0))
        d.config = cache_config(out, config, rank)
        d._export_state()

    with built_as_tree(rank), hooked_load_weights(h.DeepseekV4ForCausalLM, []):
        weight_cache.daemon_load_around(load, daemon)
    with mock.patch.object(signal, "signal"):  # the server runs on a thread: no signal handlers there
        server = threading.Thread(target=daemon.serve, daemon=True)
        server.start()
        while not Path(daemon.ready_path).exists():
            server.join(0.05)
        try:
            yield daemon
        finally:
            daemon._running = False
            server.join(10)


def engine_restart(out: Path, ckpt: Path, rank: int, daemon, device: str = "cpu") -> torch.nn.Module:
    """``launch_server --model-path OUT --weight-cache-mode client``'s loading: SGLang's own ``IpcModelLoader``."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig, LoadFormat
    from sglang.srt.model_loader.loader import get_model_loader
    from sglang.srt.weight_cache.ipc_loader import IpcModelLoader

    plugins()
    loader = get_model_loader(LoadConfig(load_format=LoadFormat.IPC_CACHE, weight_cache_mode="client",
                                         weight_cache_socket=daemon.socket_path))
    assert isinstance(loader, IpcModelLoader)
    config = tree_config(ckpt, out)
    with built_as_tree(rank):
        return loader.load_model(model_config=model_config(out, config), device_config=DeviceConfig(device, 0))


@pytest.mark.parametrize("form", ["per-rank", "store"])
def test_a_daemon_of_a_conversion_is_mapped_by_an_engine_restart_byte_exact(sglang_ckpt, sglang_converted,
                                                                            sglang_store, sockets, form):
    """Per-rank files, or a store whose rank slots the daemon reads by SGLang's own placement."""
    out = sglang_converted if form == "per-rank" else sglang_store
    with h.patched(3, EP_SIZE, REDUNDANT) as args:
        want = reference(sglang_ckpt, 3)
        with daemon_up(out, sglang_ckpt, 3, args) as daemon:
            assert getattr(daemon, weight_cache.LOADED_ATTR)
            model = engine_restart(out, sglang_ckpt, 3, daemon)
        assert_experts(model, want)
        for module in h.experts_of(model).values():
            assert module._mega_moe_weights_built and module.w13_weight_scale_inv.format_ue8m0
            assert h.shares_storage(module.mega_l1_weights[1], module.mega_w13_weight_scale_utccp)
            assert h.shares_storage(module.mega_l1_weights[0], module.w13_weight)


def test_sglangs_own_mapping_of_a_megamoe_model_is_refused_by_its_shape_check(sglang_ckpt, sglang_converted,
                                                                              sockets, monkeypatch):
    """Why the plugin shapes the meta model: without it SGLang itself refuses the mapping."""
    monkeypatch.setattr(weight_cache, "shape_as_installed", lambda model, path: None)
    with h.patched(2, EP_SIZE, REDUNDANT) as args, daemon_up(sglang_converted, sglang_ckpt, 2, args) as daemon:
        with pytest.raises(RuntimeError, match="w13_weight_scale_inv.*shape/dtype|shape/dtype mismatch"):
            engine_restart(sglang_converted, sglang_ckpt, 2, daemon)


def test_a_daemon_of_a_conversion_converted_again_is_never_mapped(sglang_ckpt, sglang_converted, sockets):
    with h.patched(1, EP_SIZE, REDUNDANT) as args, daemon_up(sglang_converted, sglang_ckpt, 1, args) as daemon:
        setattr(daemon, weight_cache.LOADED_ATTR, "0" * 32)  # what it loaded is not what OUT holds now
        with pytest.raises(RuntimeError, match="(?s)config mismatch.*converted again since this daemon loaded it"):
            engine_restart(sglang_converted, sglang_ckpt, 1, daemon)


def test_the_engine_probes_the_layout_before_mapping(sglang_ckpt, sglang_converted, sockets):
    with h.patched(0, EP_SIZE, REDUNDANT) as args, daemon_up(sglang_converted, sglang_ckpt, 0, args) as daemon:
        probe.forget()
        with mock.patch.object(mega_moe, "_interleave_mega_moe_l1_weights", _interleaved_by_16), \
                pytest.raises(InstallError) as e:
            engine_restart(sglang_converted, sglang_ckpt, 0, daemon)
    assert "\n" not in str(e.value) and "do not serve this conversion" in str(e.value)


def test_megamoe_preload_runs_sglangs_launcher_with_the_entry_in_each_daemon(sglang_converted, monkeypatch):
    """SGLang's own server args and daemon launcher; every daemon it spawns runs ``daemon_entry``."""
    from sglang.srt.weight_cache import daemon

    seen = {}

    def launch(server_args, dist_init_method=None, timeout=1800, force=False):
        seen.update(model=server_args.model_path, tp=server_args.tp_size, ep=server_args.ep_size,
                    target=daemon.run_weight_cache_daemon, timeout=timeout, force=force)

    monkeypatch.setattr(daemon, "launch_weight_cache_daemons", launch)
    preload.run_preload(str(sglang_converted), ["--tp-size", "4", "--ep-size", "4", "--moe-a2a-backend", "megamoe",
                                                "--ep-num-redundant-experts", "4", "--timeout", "60", "--force"])
    assert seen == dict(model=str(sglang_converted), tp=4, ep=4, target=preload.daemon_entry, timeout=60, force=True)
    assert daemon.run_weight_cache_daemon is not preload.daemon_entry  # put back


def test_megamoe_preload_refuses_in_one_line_what_no_sglang_daemon_serves(sglang_converted, engine_converted,
                                                                        monkeypatch):
    """The real ``megamoe`` command, in this process (SGLang already imported: tests/cli_runs.py);
    no daemon is launched for any of them."""
    from sglang.srt.weight_cache import daemon

    monkeypatch.setattr(daemon, "launch_weight_cache_daemons", mock.Mock(side_effect=AssertionError("launched")))
    for args, why in [((sglang_converted, "--engine", "vllm"), "converted for sglang's expert placement"),
                      ((engine_converted, "--engine", "sglang"), "converted for vllm's expert placement"),
                      ((sglang_converted, "--model-path", "x"), "--model-path: megamoe preload takes"),
                      ((sglang_converted, "--load-format", "dummy"), "--load-format dummy: a daemon loads")]:
        proc = run_cli("preload", "--model", *args, check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = [line for line in proc.stderr.splitlines() if line.strip()]  # SGLang's import warnings, then ours
        errors = [line for line in lines if line.startswith("error:")]
        assert errors == lines[-1:] and why in errors[0], proc.stderr[-2000:]
    assert json.loads((sglang_converted / "manifest.json").read_text())["engine"] == "sglang"


def test_the_gpu_script_runs_daemon_and_engine_in_two_processes_on_the_cpu(tmp_path):
    """``gpu_sglang_weight_cache.py --device cpu``: what the GPU run does, the daemon in a process of
    its own, torch sharing its CPU tensors with the engine's process."""
    script = Path(__file__).with_name("gpu_sglang_weight_cache.py")
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--work", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["byte_exact"] and result["layers"] == h.CONFIG["num_hidden_layers"], result
    assert result["device"] == "cpu" and result["daemon_pid"] != result["engine_pid"]
