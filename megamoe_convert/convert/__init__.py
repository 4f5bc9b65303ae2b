"""The convert stage: ``plan`` (options, units, ``--shard`` splits), ``gather`` (each unit's bytes:
experts laid out for the kernel, copies), ``run`` (the resumable job), ``fleet`` (parts and merge).
Imports ``output`` and below.
"""

from megamoe_convert.convert.plan import ConvertOptions
from megamoe_convert.convert.run import Summary, convert
from megamoe_convert.errors import ConvertError

__all__ = ["ConvertError", "ConvertOptions", "Summary", "convert"]
