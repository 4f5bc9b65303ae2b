"""The serving stage: reading a conversion back. ``converted`` (a conversion opened once, and the form
its experts are handed out in), ``loader`` (a rank's experts into tensors: its own files, or a
store's slots through ``store``), ``staging`` (the pinned ring behind a GPU load). Imports ``output``
and below; ``hub`` and ``engines`` build on it.
"""
