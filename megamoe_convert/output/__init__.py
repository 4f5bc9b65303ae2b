"""The output stage: what a conversion writes into OUT, and the rules for writing it.

Files: ``naming`` (every name below OUT), ``shards`` (what each expert file holds), ``writer``
(atomic, checksummed files), ``rank_extras`` (per-rank tensors beside the experts), ``marker``
(the marked ``config.json``). The record: ``manifest`` (the Manifest type and its checked reader),
``seal`` (the manifest's checksum of itself), ``compare`` (what ``verify --source`` compares
beyond the experts). Writing safely: ``preflight`` (checks before the first byte), ``locks`` (who
may write OUT at once), ``journal`` (what a run finished), ``stamps`` (the source a run read),
``resume`` (reusing or refusing what OUT holds), ``clearing`` (the only code that deletes).
Imports ``source`` and below.
"""
