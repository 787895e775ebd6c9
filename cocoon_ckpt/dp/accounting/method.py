"""Which dp-accounting accountant composes a run's events: a closed choice that the
config names, read without importing dp-accounting (the CLI's `--help` and the config
records start without it)."""

from __future__ import annotations

import enum

__all__ = ["AccountingMethod"]


class AccountingMethod(enum.StrEnum):
    """Which dp-accounting accountant composes the events."""

    PLD = "pld"
    """Privacy loss distributions: tight."""
    RDP = "rdp"
    """Rényi DP: looser, faster."""
