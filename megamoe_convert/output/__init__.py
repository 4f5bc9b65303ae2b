"""The output stage: what a conversion writes. ``writer`` (atomic, checksummed files), ``manifest`` (the
sealed record of a conversion), ``state`` (journal, locks, stamps: resuming and clearing OUT),
``rank_extras`` (per-rank tensors beside the experts). Imports ``source`` and below.
"""
