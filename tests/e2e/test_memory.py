"""Memory ceilings, each measured in a fresh process of its own (its peak resident set from its
start): a conversion streams, the layout transform needs the output and little more, and
``load_rank`` on the CPU maps its files instead of reading them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, run_cli

from megamoe_convert.synth.write import synthesize

# ----------------------------------------------------------------------------- convert streams

PEAK_RSS_SCRIPT = """
import resource, sys
from megamoe_convert.cli import app
try:
    app(sys.argv[1:], standalone_mode=False)
finally:
    print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


def peak_rss_mb(*args: object) -> float:
    proc = subprocess.run([sys.executable, "-c", PEAK_RSS_SCRIPT, *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = [row for row in proc.stderr.splitlines() if row.startswith("PEAK_RSS_KB")][-1]
    return int(line.split()[1]) / 1024


def test_peak_memory_does_not_grow_with_the_number_of_layers(tmp_path):
    """A 20-layer checkpoint must not need more memory than a 2-layer one (streaming)."""
    peaks = {}
    for layers in (2, 20):
        src = tmp_path / f"src{layers}"
        synthesize(src, "tiny", layers=layers, experts=128, mtp_layers=0, seed=layers)
        expert_mb = sum(p.stat().st_size for p in src.glob("*.safetensors")) / 1e6
        peaks[layers] = peak_rss_mb("convert", src, tmp_path / f"out{layers}", "--ep-size", 2, "--workers", 2,
                                    "--no-fsync")
    assert expert_mb > 100  # the 20-layer checkpoint is far bigger than any allowed growth
    print("peak RSS MB by layers:", peaks)
    assert peaks[20] - peaks[2] < 48, peaks


# ----------------------------------------------------------------------------- the transform

TRANSFORM_PEAK_SCRIPT = """
import torch
from megamoe_convert.layout import transform
E, H, I = 8, 4096, 2048
inputs = [torch.empty(shape, dtype=torch.uint8).random_() for shape in
          ((E, 2 * I, H // 2), (E, 2 * I, H // 32), (E, H, I // 2), (E, H, I // 32))]
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
before = status("VmRSS")
out = transform.transform_experts(*inputs)
print((status("VmHWM") - before) / sum(t.numel() for t in inputs))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS from /proc")
def test_transform_memory_is_the_output_and_little_more():
    """At most ~2x the expert bytes in all, i.e. the inputs plus an output of the same
    size; intermediates (scale packing) stay small. ~100 MB of experts in a fresh process.
    A ceiling only: the peak can read below the output's size (the kernel may reclaim other
    pages of the process meanwhile), and using less is never a failure."""
    proc = subprocess.run([sys.executable, "-c", TRANSFORM_PEAK_SCRIPT], capture_output=True, text=True, check=True)
    extra = float(proc.stdout)
    assert extra < 1.1, f"transform used {extra:.2f}x the input bytes on top of the inputs"


# ----------------------------------------------------------------------------- load_rank maps, never reads eagerly

LAZY_SCRIPT = """
import sys, psutil, torch
from megamoe_convert import load_rank
import megamoe_convert.convert  # imported by the shard check; keep import costs out of the measurement
proc = psutil.Process()
base = proc.memory_info().rss
layers = load_rank(sys.argv[1], 0)
after_load = proc.memory_info().rss
total = sum(t.numel() * t.element_size() for l in layers.values() for t in (*l.l1, *l.l2))
checksum = sum(int(t.sum()) for l in layers.values() for t in (*l.l1, *l.l2))
after_touch = proc.memory_info().rss
print(base, after_load, after_touch, total, checksum)
"""


def test_cpu_load_is_lazy_memory_mapped(tmp_path):
    config = json.loads((REPO / "configs" / "tiny.json").read_text())
    config.update(hidden_size=1024, moe_intermediate_size=512, n_routed_experts=48, num_hidden_layers=2,
                  num_nextn_predict_layers=0, vocab_size=256)
    (tmp_path / "preset.json").write_text(json.dumps(config))
    synthesize(tmp_path / "src", str(tmp_path / "preset.json"))
    run_cli("convert", tmp_path / "src", tmp_path / "out", "--ep-size", 1, "--experts-only", "--no-fsync")
    proc = subprocess.run([sys.executable, "-c", LAZY_SCRIPT, str(tmp_path / "out")], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    base, after_load, after_touch, total, _ = map(int, proc.stdout.split())
    assert total > 70e6
    assert after_load - base < 0.1 * total, "load_rank read the shard eagerly"
    assert after_touch - base > 0.8 * total, "touching the tensors should page the file in"
