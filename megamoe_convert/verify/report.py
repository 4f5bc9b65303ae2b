"""What ``verify`` finds: every problem collected into one report, never raised one by one."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Problem:
    where: str  # file, or "rank R layer L slot S", or tensor name
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


@dataclass
class VerifyReport:
    out: str
    problems: list[Problem] = field(default_factory=list)
    checks: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    numerics: dict[str, Any] | None = None
    bytes_hashed: int = 0
    seconds: float = 0.0
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)  # each phase: unit, count, bytes, seconds
    coverage: dict[str, Any] | None = None  # what the conversion holds (Manifest.coverage)

    @property
    def ok(self) -> bool:
        return not self.problems

    def count(self, check: str, n: int = 1) -> None:
        self.checks[check] = self.checks.get(check, 0) + n

    def problem(self, where: str, what: str) -> None:
        self.problems.append(Problem(where, what))

    def to_json(self) -> dict[str, Any]:
        hashing = self.phases.get("hash", {}).get("seconds", 0.0)
        return {"out": str(Path(self.out).resolve()), "ok": self.ok,
                "servable": self.ok and bool(self.coverage and self.coverage["servable"]),
                "partial": bool(self.coverage and self.coverage["partial"]), "coverage": self.coverage,
                "problems": [str(p) for p in self.problems],
                "checks": {k.replace(" ", "_").replace("-", "_"): v for k, v in self.checks.items()},
                "skipped": self.skipped, "numerics": self.numerics, "bytes_hashed": self.bytes_hashed,
                "seconds": round(self.seconds, 3), "phases": self.phases,
                "hash_gb_per_s": round(self.bytes_hashed / hashing / 1e9, 3) if hashing > 0 else 0.0}
