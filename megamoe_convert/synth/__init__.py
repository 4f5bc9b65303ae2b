"""Synthetic checkpoints for tests, demos and benchmarks: ``tensors`` (DeepSeek-V4/V4.1 names, dtypes,
shapes), ``kimi`` (Kimi-K3's), ``write`` (presets -> files on disk).
"""

from megamoe_convert.synth.tensors import PRESETS
from megamoe_convert.synth.write import SynthError, synthesize

__all__ = ["PRESETS", "SynthError", "synthesize"]
