"""megamoe-convert: pre-bake DeepSeek-V4, V4.1 and Kimi-K3 MoE experts into DeepGEMM's MegaMoE per-rank layout.

The pipeline, one stage per folder, imports pointing down only (``docs/architecture.md``):
``source/`` (checkpoints, families, formats) -> ``placement``, ``layout`` (pure functions) ->
``output/`` (writer, manifest, journal and locks) -> ``convert/`` -> ``serve/`` (loading, hub) ->
``engines/`` (one package per engine, one module per contract) -> ``verify`` -> ``cli/``. Small helpers at the
bottom: ``jsonio``, ``progress``, ``ui``, ``faults``, ``devices``.
"""

__version__ = "0.1.0"
