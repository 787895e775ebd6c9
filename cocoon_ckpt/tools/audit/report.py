"""What an audit found: one `Finding` per thing that does not hold, gathered with what
each check covered into an `AuditReport`, which prints as text or JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["AuditReport", "Finding"]


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing that does not hold."""

    check: str
    """Which check found it: chain, checksums, noise, accountant, fingerprint, key,
    permissions."""
    message: str
    """What is wrong, where, and what to do."""
    version: int | None = None

    def as_json(self) -> dict[str, Any]:
        """The finding as a JSON object (`check`, `version`, `message`)."""
        return {"check": self.check, "version": self.version, "message": self.message}


@dataclass(slots=True)
class AuditReport:
    """What the audit checked and found. `ok` when nothing was found."""

    store: str
    findings: list[Finding] = field(default_factory=list)
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per check: what it covered (counts, seeds, deviations)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Threat model, key presence, who can read the store, epsilon."""
    plots: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Checks not run, each with why and how to run it (e.g. no job was given)."""

    @property
    def ok(self) -> bool:
        return not self.findings

    def add(self, check: str, message: str, version: int | None = None) -> None:
        """Record a finding of `check` (about `version`, or the store as a whole)."""
        self.findings.append(Finding(check, message, version))

    def as_json(self) -> dict[str, Any]:
        """The report as printed by `cocoon-ckpt audit --json`."""
        return {
            "store": self.store,
            "ok": self.ok,
            "findings": [f.as_json() for f in self.findings],
            "checks": self.checks,
            "info": self.info,
            "skipped": self.skipped,
            "plots": self.plots,
        }

    def text(self) -> str:
        """The report as printed by `cocoon-ckpt audit`: checks, info, skipped checks,
        findings and plots, one per line."""
        lines = [f"audit of {self.store}: " + ("all checks hold" if self.ok else "FINDINGS")]
        for name, c in self.checks.items():
            detail = ", ".join(f"{k}={v}" for k, v in c.items())
            lines.append(f"  {name:<12} {detail}")
        for k, v in self.info.items():
            if isinstance(v, dict):
                v = ", ".join(f"{a}={b}" for a, b in v.items() if not isinstance(b, dict))
            lines.append(f"  {k}: {v}")
        for sk in self.skipped:
            lines.append(f"SKIPPED: {sk}")
        for f in self.findings:
            where = f" (version {f.version})" if f.version is not None else ""
            lines.append(f"FINDING [{f.check}]{where}: {f.message}")
        for p in self.plots:
            lines.append(f"  plot: {p}")
        return "\n".join(lines)
