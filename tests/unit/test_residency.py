"""How the GPU path sizes its pinned ring for a conversion: read on real conversions on disk, read
into the page cache, dropped from it, large and small."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, disk_folder, drop_from_page_cache, nowait_supported

from megamoe_convert.output.manifest import read_manifest
from megamoe_convert.serve import staging
from megamoe_convert.serve.residency import conversion_load


def _conversion_on_disk(tiny_converted, tmp_path, cached=True):
    out = disk_folder(tmp_path) / "out"
    shutil.copytree(tiny_converted, out)
    files = [out / record.path for record in read_manifest(out).files]
    for path in files:
        path.read_bytes() if cached else drop_from_page_cache(path)
    return out, files


def test_a_conversion_read_a_moment_ago_is_cached_and_one_dropped_from_the_page_cache_is_not(
        tiny_converted, tmp_path):
    out, files = _conversion_on_disk(tiny_converted, tmp_path)
    manifest = read_manifest(out)
    share = sum(r.size for r in manifest.files) // max(manifest.ep_size, torch.cuda.device_count())
    assert conversion_load(out) == (True, share) and share > 0
    for path in files:
        drop_from_page_cache(path)
    assert conversion_load(out) == (not nowait_supported(files[0]), share)


def test_one_file_dropped_among_many_makes_the_conversion_cold(tiny_converted, tmp_path):
    out, files = _conversion_on_disk(tiny_converted, tmp_path)
    drop_from_page_cache(files[0])  # the first is always among those looked at
    assert conversion_load(out)[0] is (not nowait_supported(files[0]))


def test_what_is_no_conversion_is_loaded_as_a_small_warm_one_and_the_install_says_what_is_wrong(tmp_path):
    assert conversion_load(tmp_path) == (True, 0)  # no manifest
    assert conversion_load(tmp_path / "missing") == (True, 0)
    assert staging.ring_for(tmp_path) == staging.ring_for(None) == staging.ring_buffers()


def test_the_ring_has_two_buffers_a_lane_for_a_cold_or_a_large_load_and_one_for_a_small_warm_one(
        tiny_converted, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAMOE_READ_THREADS", "5")
    out, files = _conversion_on_disk(tiny_converted, tmp_path)
    assert staging.ring_for(out) == 5
    with monkeypatch.context() as patch:
        patch.setattr(staging, "LARGE_LOAD_BYTES", conversion_load(out)[1])  # this one is large
        assert staging.ring_for(out) == 10
    for path in files:
        drop_from_page_cache(path)
    assert staging.ring_for(out) == (10 if nowait_supported(files[0]) else 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_engine_loading_a_conversion_out_of_the_page_cache_pins_a_cold_loads_ring(tiny_converted, tmp_path):
    sizes = {}
    for cached in (False, True):
        out, _ = _conversion_on_disk(tiny_converted, tmp_path / str(cached), cached)
        code = ("from megamoe_convert.serve import staging; staging.prepare_gpu_staging(%r).join(); "
                "print(len(staging._RING.buffers))" % str(out))
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
        sizes[cached] = int(proc.stdout.split()[-1])
    assert sizes == {False: staging.ring_buffers(cold=True), True: staging.ring_buffers()}
