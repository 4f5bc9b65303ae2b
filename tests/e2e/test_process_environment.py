"""What a command reads from its process's environment once, at its start, or from the rights it
runs with: the Hugging Face hub's endpoint and offline mode (read when the library is imported),
permissions enforced for root too, the GPU path's settings in a fresh process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli, run_cli_process
from damage import EP2, RANK0, copy, one_line_refusal, problems
from hub_fake import cache_put


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("src") / "tiny"
    run_cli("synth", path)
    return path


@pytest.fixture(scope="module")
def ep2(src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ep2") / "out"
    run_cli("convert", src, out, *EP2)
    return out


# ----------------------------------------------------------------------------- the Hugging Face hub's settings

def test_push_without_a_network_is_one_line(ep2):
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "hf_x", "HF_HUB_OFFLINE": "0", "HF_HUB_ETAG_TIMEOUT": "1"}
    one_line_refusal(run_cli_process("push", ep2, "someone/model", check=False, env=env), "someone/model")


REPO_ID = "team/tiny-ep4"
SMALL = {"config.json", "tokenizer_config.json"}


def rank_files(rank: int) -> set[str]:
    return {f"rank-0000{rank}-of-00004/{layer}.safetensors" for layer in ("layers.0", "layers.1", "mtp.0")}


def converted_files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(out).parts)}


@pytest.fixture()
def offline_cache(tmp_path, tiny_ckpt, tiny_converted) -> Path:
    """A real-layout HF cache: the source checkpoint, and a pushed conversion of which only
    the manifest, the small files and rank 2 were ever downloaded."""
    cache = tmp_path / "hf-cache"
    cache_put(cache, "deepseek-fake/tiny-v4", "1" * 40, {p.name: p for p in tiny_ckpt.iterdir()})
    keep = {"manifest.json"} | SMALL | rank_files(2)
    cache_put(cache, REPO_ID, "2" * 40, {rel: tiny_converted / rel for rel in keep})
    return cache


def test_cli_offline_convert_from_repo_id_and_pull(offline_cache, tiny_converted, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(offline_cache), "COLUMNS": "200"}

    def start(*args: object) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "megamoe_convert.cli", *map(str, args)], cwd=REPO, env=env,
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    out = tmp_path / "out"
    procs = [start("convert", "deepseek-fake/tiny-v4", out, "--ep-size", 4, "--num-redundant-experts", 4, "--json"),
             start("pull", REPO_ID, "--ranks", "2", "--experts-only", "--json")]
    (c_out, c_err), (p_out, p_err) = (p.communicate(timeout=300) for p in procs)
    assert [p.returncode for p in procs] == [0, 0], (c_err, p_err)
    got, want = converted_files(out), converted_files(tiny_converted)
    assert {k: v for k, v in got.items() if k != "manifest.json"} == \
        {k: v for k, v in want.items() if k != "manifest.json"}
    source = json.loads(got["manifest.json"])["source"]["path"]
    assert source == str(offline_cache / "models--deepseek-fake--tiny-v4" / "snapshots" / ("1" * 40))
    pulled = json.loads(p_out)
    assert pulled["ranks"] == [2] and pulled["files"] == 5 and pulled["verified"] == "checksum"


# ----------------------------------------------------------------------------- files root could read

#: Root reads anything: without the two capabilities that let it, it is held to the permission bits.
NO_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
               "--inh-caps=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []


def run_unprivileged(*args: str) -> subprocess.CompletedProcess[str]:
    if NO_OVERRIDE and shutil.which("setpriv") is None:
        pytest.fail("running as root needs setpriv (util-linux) to drop the permission override")
    return subprocess.run([*NO_OVERRIDE, sys.executable, *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**os.environ, "COLUMNS": "200"})


def test_unreadable_rank_file_and_folder_are_refused_and_verify_goes_on(ep2, src, tmp_path):
    """Mode 000 on a rank file and on a rank folder, read without root's permission override
    (``setpriv`` drops CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH, so reads really fail)."""
    out = copy(ep2, tmp_path)
    (out / RANK0 / "layers.0.safetensors").chmod(0)
    (out / "rank-00001-of-00002").chmod(0)
    try:
        code = ("from megamoe_convert.errors import MegamoeError\n"
                "from megamoe_convert import load_rank\n"
                f"for rank, verify in ((0, True), (0, False), (1, False)):\n"
                f"    try: load_rank({str(out)!r}, rank, verify=verify)\n"
                "    except MegamoeError as e: print('refused |', e)\n")
        proc = run_unprivileged("-c", code)
        lines = proc.stdout.splitlines()
        assert proc.returncode == 0 and len(lines) == 3, proc.stdout + proc.stderr
        assert all(line.startswith("refused | ") and "Permission denied" in line for line in lines), lines
        proc = run_unprivileged("-m", "megamoe_convert.cli", "verify", str(out), "--source", str(src))
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
        found = problems(proc)
        assert f"{RANK0}/layers.0.safetensors: cannot be read (Permission denied)" in found
        assert "rank-00001-of-00002/mtp.0.safetensors: cannot be read (Permission denied)" in found
        assert "expert slots vs source" in proc.stdout  # it went on: rank 0's other layers were compared
    finally:
        (out / "rank-00001-of-00002").chmod(0o755)


# ------------------------------------------------------------------------ the GPU path's settings, in a fresh process

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fast_pin", ["1", "0"])
def test_cuda_staging_ring_is_page_locked_either_way_and_loads_exact_bytes(tiny_converted, fast_pin):
    """The ring pinned by torch's allocator (the default, also the fallback) or by registering huge-page
    memory (``MEGAMOE_FAST_PIN=1``) is page-locked, and a fresh process's first load through it equals
    the CPU load."""
    code = f"""
import torch
from megamoe_convert.serve import staging
from megamoe_convert.serve.loader import load_rank
from megamoe_convert.source import formats
ring = staging.shared_ring()
assert all(b.is_pinned() for b in ring.buffers), "ring buffers are not page-locked"
assert (ring._mapping is not None) == {fast_pin == "1"}, "the ring was not pinned the requested way"
for rank in range(4):
    cpu, gpu = load_rank({str(tiny_converted)!r}, rank), load_rank({str(tiny_converted)!r}, rank, device="cuda")
    for prefix in cpu:
        for a, b in zip((*cpu[prefix].l1, *cpu[prefix].l2), (*gpu[prefix].l1, *gpu[prefix].l2)):
            assert torch.equal(a, b.cpu())
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "MEGAMOE_FAST_PIN": fast_pin, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_process_ending_while_the_ring_is_pinned_exits_cleanly():
    """An engine that fails (or ends) right after its loader started pinning must exit normally,
    not abort with CUDA torn down under a registration (seen on the H100 before the fix)."""
    code = ("import torch; torch.cuda.init(); from megamoe_convert.serve import staging; "
            "staging.prepare_gpu_staging(); torch.empty(1 << 20, device='cuda').copy_(torch.ones(1 << 20))")
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.returncode == 0, proc.stderr[-2000:]
