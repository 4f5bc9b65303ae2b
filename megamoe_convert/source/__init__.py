"""The source stage: reading what a model ships. ``families`` (which checkpoints, their config keys and
tensor names), ``formats`` (the MegaMoE weight formats: the one table of their layouts), ``checkpoint``
(a checkpoint's tensors and dims), ``safetensors_io`` (byte ranges of safetensors files), ``layers``
(the layer key every stage shares). Imports only the helpers at the bottom and ``layout``.
"""
