"""The serving stage's error: a rank that cannot be loaded. Below the loader and the hub, which both raise it."""


class LoadError(ValueError):
    """A rank that cannot be loaded from this directory, and why."""
