"""megamoe-convert: pre-bake DeepSeek-V4, V4.1 and Kimi-K3 MoE experts into DeepGEMM's MegaMoE per-rank layout.

Modules, one concept each: :mod:`.families` (which checkpoints, their tensor names),
:mod:`.checkpoint` (reading the source), :mod:`.formats` (weight formats), :mod:`.placement`
(experts -> ranks), :mod:`.layout` (the byte-exact transform), :mod:`.convert` (the
streaming job), :mod:`.writer` (atomic files), :mod:`.manifest`, :mod:`.loader`
(serving side), :mod:`.vllm_integration`, :mod:`.verify`, :mod:`.cli`.
"""

__version__ = "0.1.0"
