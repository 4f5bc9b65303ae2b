"""``megamoe_convert.loader``, where the README and other tools import ``load_rank`` from: the very
module :mod:`megamoe_convert.serve.loader` under its first name (one module object, so patching or
reading attributes through either name sees the same state)."""

import sys

from megamoe_convert.serve import loader as _loader

sys.modules[__name__] = _loader
