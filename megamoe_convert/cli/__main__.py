"""``python -m megamoe_convert.cli``: the ``megamoe`` console script."""

from megamoe_convert.cli import main

main()
