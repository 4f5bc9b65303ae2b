"""The manifest's checksum of itself.

A manifest lists every file's size and checksum, so whoever edits one file can edit its entry
too; sealing the manifest (xxh3-128 of its canonical JSON, stored in :data:`SEAL_KEY`) makes an
edit of the manifest itself detectable as well. Tests use :func:`seal` to forge an edit that
only the deeper checks (``verify --source``) can catch.
"""

from __future__ import annotations

import json
from typing import Any

import xxhash

from megamoe_convert import jsonio

SEAL_KEY = "manifest_checksum"


def _canonical(data: dict[str, Any]) -> bytes:
    body = {k: v for k, v in data.items() if k != SEAL_KEY}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def seal(data: dict[str, Any]) -> str:
    """The manifest text of ``data`` with its own checksum added."""
    sealed = dict(data, **{SEAL_KEY: xxhash.xxh3_128_hexdigest(_canonical(data))})
    return json.dumps(sealed, indent=1) + "\n"


def check_seal(data: dict[str, Any], f: jsonio.Fields) -> None:
    """Raise ``f``'s error where ``data`` carries no seal or one that does not match its content."""
    if SEAL_KEY not in data:
        raise f.fail(f"no {SEAL_KEY} (every manifest carries its own checksum)")
    if f.str(data, SEAL_KEY) != xxhash.xxh3_128_hexdigest(_canonical(data)):
        raise f.fail(f"{SEAL_KEY} does not match its content (the manifest is corrupted or was edited)")
