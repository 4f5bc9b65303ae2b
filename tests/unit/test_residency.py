"""Whether a conversion is in the page cache, which sizes the GPU path's pinned ring: read on real
conversions on disk, dropped from the page cache and read back."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, disk_folder, drop_from_page_cache, nowait_supported

from megamoe_convert.output.manifest import read_manifest
from megamoe_convert.serve import staging
from megamoe_convert.serve.residency import conversion_cached


def _conversion_on_disk(tiny_converted, tmp_path):
    out = disk_folder(tmp_path) / "out"
    shutil.copytree(tiny_converted, out)
    return out, [out / record.path for record in read_manifest(out).files]


def test_a_conversion_read_a_moment_ago_is_cached_and_one_dropped_from_the_page_cache_is_not(
        tiny_converted, tmp_path):
    out, files = _conversion_on_disk(tiny_converted, tmp_path)
    for path in files:
        path.read_bytes()
    assert conversion_cached(out) is True
    for path in files:
        drop_from_page_cache(path)
    assert conversion_cached(out) is (not nowait_supported(files[0]))


def test_one_file_dropped_among_many_makes_the_conversion_cold(tiny_converted, tmp_path):
    out, files = _conversion_on_disk(tiny_converted, tmp_path)
    for path in files:
        path.read_bytes()
    drop_from_page_cache(files[0])  # the first is always among those looked at
    assert conversion_cached(out) is (not nowait_supported(files[0]))


def test_what_is_no_conversion_counts_as_cached_and_the_install_says_what_is_wrong(tmp_path):
    assert conversion_cached(tmp_path) is True  # no manifest
    assert conversion_cached(tmp_path / "missing") is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_engine_loading_a_conversion_out_of_the_page_cache_pins_a_cold_loads_ring(tiny_converted, tmp_path):
    out, files = _conversion_on_disk(tiny_converted, tmp_path)
    sizes = {}
    for cold in (True, False):
        for path in files:
            drop_from_page_cache(path) if cold else path.read_bytes()
        code = ("from megamoe_convert.serve import staging; staging.prepare_gpu_staging(%r).join(); "
                "print(len(staging._RING.buffers))" % str(out))
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
        sizes[cold] = int(proc.stdout.split()[-1])
    assert sizes == {True: staging.ring_buffers(cold=True), False: staging.ring_buffers()}
