"""vLLM 0.33's weight-cache daemon serving a conversion (``megamoe preload``, ``--load-format
ipc_cache``), with vLLM's own ``weight_cache`` code on the CPU.

CUDA IPC itself cannot run here: vLLM's ``TensorEntry`` ships CPU tensors by value, through the
same pickled Unix-socket protocol the daemon and the engine speak. Patched: only what needs an
accelerator (the platform's IPC check, the device index and UUID) and process groups
(``h.weight_cache_patched``, which the daemon benchmark uses too), and the model's GPU
constructor, whose place the harness's tree of vLLM's own classes takes.
"""

from __future__ import annotations

import multiprocessing
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator
from unittest import mock

import pytest
import torch
import vllm_harness as h
from cli_runs import run_cli

pytestmark = pytest.mark.only_kernel_layout  # vLLM >= 0.33: the weight cache exists there only

EP = 4


def megamoe(*args: object, check: bool = False) -> subprocess.CompletedProcess:
    """The real ``megamoe`` command, in this engine's environment: in this process (vLLM already
    imported), through the console script's own entry (``tests/cli_runs.py``)."""
    return run_cli(*args, check=check, timeout=600)


def run_convert(src: Path, out: Path, *args: object) -> Path:
    megamoe("convert", src, out, *args, check=True)
    return out


# --------------------------------------------------------------------------------------
# Conversions and vLLM's own configs for them
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ep4(engine_ckpt, tmp_path_factory) -> Path:
    """EP 4, no redundant experts: what the daemon can serve."""
    return run_convert(engine_ckpt, tmp_path_factory.mktemp("wc") / "ep4", "--ep-size", EP)


@pytest.fixture(scope="module")
def ep2(engine_ckpt, tmp_path_factory) -> Path:
    """The same source, EP 2: the same top-level shards, other rank files."""
    return run_convert(engine_ckpt, tmp_path_factory.mktemp("wc") / "ep2", "--ep-size", 2)


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wc-nvfp4")
    megamoe("synth", root / "ckpt", "--format", "nvfp4", check=True)
    return run_convert(root / "ckpt", root / "out", "--ep-size", EP)


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """Short: a daemon socket's path must fit AF_UNIX's 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="wc", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def engine_config(model: Path, **load):
    """vLLM's own ``VllmConfig`` for ``model``, as ``vllm serve`` / ``vllm preload`` build it."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), **load).create_engine_config()


def plugins() -> None:
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # megamoe-convert's vllm.general_plugins entry point


# --------------------------------------------------------------------------------------
# The daemon and the engine, each with vLLM's own code
# --------------------------------------------------------------------------------------

def tree(config, rank: int, ep: int = EP) -> torch.nn.Module:
    """The model vLLM builds (the harness's tree of its own classes), its own ``load_weights``
    fed what vLLM's default iterator reads (the tree holds only the MoE layers: nothing else has
    a parameter to go to)."""
    model = h.build_main_model(config, rank, ep, 0)

    def load_weights(weights) -> None:
        for _ in weights:
            pass

    model.load_weights = load_weights
    return model


def serve(out: Path, socket_dir: Path, rank: int, ep: int = EP) -> threading.Thread:
    """A daemon as ``megamoe preload`` starts it: vLLM's own ``WeightCacheDaemon`` on vLLM's own
    config with ``--load-format megamoe``, its own ``get_model`` (the model's constructor aside)
    and ``serve_forever`` on a real Unix socket, in a thread."""
    from vllm.config import set_current_vllm_config

    daemon_py = h.weight_cache("daemon")
    plugins()
    config = engine_config(out, load_format="megamoe")
    daemon = daemon_py.WeightCacheDaemon(config, global_rank=0, local_rank=0, distributed_init_method="",
                                         socket_dir=str(socket_dir))
    hf = h.hf_config(out)
    with set_current_vllm_config(config), \
            mock.patch("vllm.model_executor.model_loader.base_loader.BaseModelLoader.create_model",
                       lambda self, vllm_config, model_config, prefix="": tree(hf, rank, ep)):
        daemon.model = daemon.get_model()
    daemon.loaded_rope_parameters_hash = h.weight_cache("protocol").hash_rope_parameters(daemon.model_config)
    ready = threading.Event()
    thread = threading.Thread(target=daemon.serve_forever, kwargs={"ready_callback": ready.set}, daemon=True)
    thread.start()
    assert ready.wait(60), "the daemon never bound its socket"
    thread.daemon_obj = daemon  # type: ignore[attr-defined]
    return thread


def engine_load(out: Path, socket_dir: Path, rank: int, loader_cls: type | None = None, **extra) -> torch.nn.Module:
    """``vllm serve OUT --load-format ipc_cache``'s model load: vLLM's own loader (the registered
    one unless ``loader_cls``) builds the model on ``meta`` and maps the daemon's tensors, or
    falls back to a disk load."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    plugins()
    config = engine_config(out, load_format="ipc_cache",
                           model_loader_extra_config={"socket_dir": str(socket_dir), **extra})
    loader = loader_cls(config.load_config) if loader_cls else get_model_loader(config.load_config)
    hf = h.hf_config(out)
    build = lambda vllm_config, model_config, prefix="": tree(hf, rank)  # noqa: E731
    with set_current_vllm_config(config), mock.patch.object(h.weight_cache("ipc_loader"), "initialize_model", build), \
            mock.patch("vllm.model_executor.model_loader.base_loader.initialize_model", build):
        return loader.load_model(config, config.model_config)


def reference(engine_ckpt: Path, rank: int) -> torch.nn.Module:
    """vLLM's own loading of the source checkpoint."""
    config = h.hf_config(engine_ckpt)
    main = h.build_main_model(config, rank, EP, 0)
    h.vllm_load(main, h.build_mtp_model(config, rank, EP, 0), engine_ckpt)
    return main


def assert_experts_as_vllm_loads_the_source(model, engine_ckpt: Path, rank: int) -> None:
    want = h.experts_of(reference(engine_ckpt, rank))
    got = h.experts_of(model)
    assert sorted(got) == sorted(want)
    for prefix, module in got.items():
        assert all(t.device.type == "cpu" for t in h.kernel_view(module)), f"{prefix}: left on meta"
        h.assert_same_tensors(h.kernel_view(module), h.kernel_view(want[prefix]), prefix)


# --------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("rank", [0, 3])
def test_engine_maps_a_daemons_conversion_byte_exact(engine_ckpt, ep4, socket_dir, rank):
    """Daemon: vLLM's ``get_model`` with ``--load-format megamoe``; its ``get_state`` exports
    (``export_entries``) over the socket; engine: the meta model, the daemon's tensors registered
    in place, ``process_weights_after_loading`` in pre-processed mode. No fallback allowed."""
    with h.weight_cache_patched(rank, EP):
        serve(ep4, socket_dir, rank)
        model = engine_load(ep4, socket_dir, rank, fallback=False)
        assert_experts_as_vllm_loads_the_source(model, engine_ckpt, rank)
        assert not any(p.device.type == "meta" for p in model.parameters())


def test_cache_key_tells_conversions_apart(engine_ckpt, ep4, ep2, tmp_path):
    """vLLM's key hashes the top-level shards' headers only: the same for every conversion of one
    source. With megamoe-convert registered it also hashes the manifest and the rank files (or a
    store's layer files)."""
    protocol = h.weight_cache("protocol")
    plugins()
    vllm_hash = protocol.hash_checkpoint.__wrapped__
    copy = Path(shutil.copytree(ep4, tmp_path / "copy-of-ep4"))

    def key(out: Path):
        config = engine_config(out)
        return protocol.WeightCacheKey.from_model_config(config.model_config, tp_size=1, tp_rank=0,
                                                         cache_config=config.cache_config)

    with mock.patch.object(protocol, "hash_checkpoint", vllm_hash):
        assert key(ep4) == key(ep2)  # what vLLM alone cannot tell apart
    assert key(ep4).mismatched_fields(key(ep2)) == ["checkpoint"]
    store = run_convert(engine_ckpt, tmp_path / "store")  # no --ep-size: the rank-agnostic store
    assert len({key(ep4).checkpoint, key(ep2).checkpoint, key(store).checkpoint}) == 3
    assert key(copy) == key(ep4)  # identical weights in another directory still match, as vLLM intends
    assert protocol.hash_checkpoint(str(engine_ckpt)) == vllm_hash(str(engine_ckpt))  # a plain checkpoint: vLLM's
    (copy / "rank-00001-of-00004" / "layers.1.safetensors").unlink()
    assert key(copy) != key(ep4)


def test_engine_refuses_a_daemon_of_another_conversion(engine_ckpt, ep4, ep2, socket_dir):
    """A daemon holding EP 2's conversion: the engine of EP 4's sees another key, never its experts."""
    mismatch = h.weight_cache("protocol").CacheConfigMismatchError
    with h.weight_cache_patched(0, 2):
        serve(ep2, socket_dir, 0, ep=2)
    with h.weight_cache_patched(0, EP):
        with pytest.raises(mismatch, match=r"mismatch on fields: \['checkpoint'\]"):
            engine_load(ep4, socket_dir, 0, fallback=False)


def test_fallback_loads_the_experts_where_vllms_own_reads_none(engine_ckpt, ep4, socket_dir):
    """No daemon at the socket: vLLM's own ``IpcModelLoader`` falls back to ``DefaultModelLoader("auto")``,
    which reads no expert from a conversion; the one megamoe-convert registers falls back to
    ``--load-format megamoe``."""
    with h.weight_cache_patched(2, EP):
        bare = engine_load(ep4, socket_dir, 2, loader_cls=h.weight_cache("ipc_loader").IpcModelLoader)
        assert all(torch.count_nonzero(t) == 0 for m in h.experts_of(bare).values() for t in h.kernel_view(m))
        model = engine_load(ep4, socket_dir, 2)
        assert_experts_as_vllm_loads_the_source(model, engine_ckpt, 2)


def test_engine_never_maps_nvfp4_from_a_daemon(nvfp4, socket_dir):
    """NVFP4's L2 activation scale is a plain attribute the weight cache does not carry: refused
    before any daemon is asked (with fallback on, the disk load follows)."""
    mismatch = h.weight_cache("protocol").CacheConfigMismatchError
    with h.weight_cache_patched(0, EP):
        with pytest.raises(mismatch, match="NVFP4 experts: vLLM's weight cache does not carry their L2 activation"):
            engine_load(nvfp4, socket_dir, 0, fallback=False)


def _spawned_daemon_probe(queue) -> None:
    """In a process spawned as vLLM spawns its daemons: is ``megamoe`` a load format, before and
    after what :func:`daemon_entry` does first?"""
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from megamoe_convert.engines.vllm import preload

    def loader() -> str:
        try:
            return type(get_model_loader(LoadConfig(load_format="megamoe"))).__name__
        except ValueError as e:
            return str(e)

    before = loader()
    preload.prepare_daemon()
    queue.put((before, loader(), getattr(h.weight_cache("protocol").hash_checkpoint, "megamoe", False)))


def test_a_spawned_daemon_knows_megamoe_only_through_daemon_entry():
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=_spawned_daemon_probe, args=(queue,))
    process.start()
    before, after, key = queue.get(timeout=300)
    process.join(60)
    assert before == "Load format `megamoe` is not supported"
    assert (after, key) == ("MegaMoEModelLoader", True)


def test_daemon_entry_is_vllms_run_daemon_after_the_registration():
    """``spawn`` pickles the target by reference: the entry must be a module-level function
    that resolves to itself."""
    import pickle

    from megamoe_convert.engines.vllm import preload

    assert pickle.loads(pickle.dumps(preload.daemon_entry)) is preload.daemon_entry
    calls = []
    with mock.patch.object(h.weight_cache("daemon"), "_run_daemon", lambda *a, **k: calls.append((a, k))), \
            mock.patch.object(preload, "prepare_daemon", lambda: calls.append("prepared")):
        preload.daemon_entry(0, 0, "config", init_method="tcp://x")
    assert calls == ["prepared", ((0, 0, "config"), {"init_method": "tcp://x"})]


def test_megamoe_preload_runs_vllms_preload_with_the_entry_in_each_daemon(ep4, socket_dir, tmp_path):
    """The real command and vLLM's real ``PreloadSubcommand.cmd``, one patch (its CUDA IPC platform
    check): the spawned daemon runs :func:`daemon_entry`, registers megamoe-convert, enters vLLM's
    ``_run_daemon`` and builds vLLM's ``WeightCacheDaemon``; then, on a machine without a GPU, it
    stops where vLLM needs the accelerator."""
    script = tmp_path / "preload.py"
    script.write_text(
        "import sys\nfrom unittest import mock\nimport vllm.entrypoints.cli.preload as p\n"
        "from megamoe_convert.cli import main\n"
        "if __name__ == '__main__':  # spawned daemons import this file as __mp_main__\n"
        "    with mock.patch.object(p, 'check_ipc_platform_support', lambda: None):\n"
        "        sys.argv = ['megamoe', '--debug', 'preload', *sys.argv[1:]]\n        main()\n")
    done = subprocess.run([sys.executable, script, "--model", ep4, "--weight-cache-socket-dir", socket_dir],
                          capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 1, log
    assert "MegaMoEIpcModelLoader" in log  # registered in the daemon (vLLM warns ipc_cache is overridden)
    chain = ["Process vllm-weight-cache-target-0", "preload.py", "in daemon_entry", "daemon.py",
             "in _run_daemon", "daemon.load_model()", "set_device_index",
             "Cannot access accelerator device when none is available"]
    at = [done.stderr.find(step) for step in chain]
    assert -1 not in at and at == sorted(at), list(zip(chain, at, strict=False))
    assert "Weight cache daemon rank(s) exited during startup (exitcodes=[1])" in log
    assert "not supported" not in log


def test_megamoe_preload_refuses_what_the_daemon_cannot_serve(engine_converted, engine_experts_only, nvfp4, ep4,
                                                             engine_ckpt):
    """One line, exit 2, before vLLM is asked to start anything."""
    cases = [
        ((engine_converted,), "converted with 4 redundant experts, which need EPLB, and vLLM's weight-cache "
                              "daemon refuses EPLB; convert again with --num-redundant-experts 0"),
        ((engine_experts_only,), "converted with --experts-only"),
        ((nvfp4,), "NVFP4 experts: vLLM's weight cache does not carry their L2 activation scale"),
        ((engine_ckpt,), "manifest.json: missing"),
        ((ep4, "--enable-eplb"), "--enable-eplb: vLLM's weight-cache daemon does not support EPLB"),
        ((ep4, "--load-format", "safetensors"), "--load-format safetensors: megamoe preload loads a conversion "
                                                "with --load-format megamoe"),
    ]
    from vllm.entrypoints.cli.preload import PreloadSubcommand

    started = AssertionError("vLLM's preload was started")
    for (model, *flags), message in cases:
        with mock.patch.object(PreloadSubcommand, "cmd", side_effect=started):
            done = megamoe("preload", "--model", model, *flags)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and lines[-1].startswith("error: ") and message in lines[-1], done.stderr
        assert "weight-cache-target" not in done.stderr and "Traceback" not in done.stderr


def test_bench_daemon_smoke(tmp_path):
    """``benchmarks/bench_daemon.py --smoke``: every role in its own process on the CPU, the daemon's
    experts mapped by an engine, all kernel views identical."""
    save = tmp_path / "smoke.json"
    done = subprocess.run([sys.executable, Path(__file__).parents[2] / "benchmarks" / "bench_daemon.py", "--smoke",
                           "--work", tmp_path / "work", "--save", save], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    result = __import__("json").loads(save.read_text())
    roles = [key if key != "daemon" else f"daemon-{r[key]['from']}" for r in result["runs"] for key in r
             if key != "dropped"]
    assert sorted(roles) == ["daemon-prebaked", "daemon-source", "engine", "install"]
    assert result["identical"] and result["setup"]["rank_bytes"] > 0
