"""``LoadError``, where the serve stage has always exported it (defined in :mod:`megamoe_convert.errors`)."""

from megamoe_convert.errors import LoadError

__all__ = ["LoadError"]
