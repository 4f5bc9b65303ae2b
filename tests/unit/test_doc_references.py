"""Every test the documents name is there: a path under ``tests/`` names a file that exists, and a
``FILE.py::test_name`` (with its folder or without) names a test that file defines, so a test moved
between tiers or renamed cannot leave a document pointing at nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "benchmarks").glob("*.md"))]
#: ``tests/unit/test_x.py``, ``tests/engines/test_*_y.py``, ``test_x.py::test_name`` or ``test_x.py::test_*``.
REFERENCE = re.compile(r"(?<![\w/.])((?:tests/)?[\w/*]*?(?:test_[\w*]+|[\w]+)\.py)(?:::([\w*]+))?")
TESTS = REPO / "tests"


def references() -> list[tuple[str, str, str | None]]:
    """``(document, path, test name or None)`` for every test file or test a document names."""
    found = []
    for doc in DOCS:
        for path, name in REFERENCE.findall(doc.read_text()):
            if path.startswith("tests/") or (name and path.startswith("test_")):
                found.append((doc.relative_to(REPO).as_posix(), path, name or None))
    return found


def files_named(path: str) -> list[Path]:
    """The files a reference means: its path (a glob) from the repository, or, for a bare file
    name, every file of that name under tests/."""
    return sorted(REPO.glob(path)) if path.startswith("tests/") else sorted(TESTS.rglob(path))


def test_documents_name_tests():
    assert len(references()) > 20 and any(name for _, _, name in references())


@pytest.mark.parametrize("doc, path, name", references())
def test_a_named_test_file_or_test_exists(doc, path, name):
    files = files_named(path)
    assert files, f"{doc}: {path} names no file"
    if name is None:
        return
    assert len(files) == 1 or "*" in path, f"{doc}: {path} is ambiguous: {[f.relative_to(REPO) for f in files]}"
    test = name.replace("*", r"\w*")
    pattern = re.compile(rf"^def {test}\(", re.M)
    assert any(pattern.search(f.read_text()) for f in files), f"{doc}: no test {path}::{name}"
