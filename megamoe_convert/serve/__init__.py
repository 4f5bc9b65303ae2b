"""The serving stage: reading a conversion back. ``loader`` (a rank's experts into tensors, locally),
``hub`` (conversions and sources on the Hugging Face Hub), ``errors`` (``LoadError``).
Imports ``output`` and below; ``engines`` builds on it.
"""

from megamoe_convert.serve import store as _store  # noqa: E402,F401  (registers the store reader with loader)
