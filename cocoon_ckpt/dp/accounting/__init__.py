"""Accounting: what a run's noise costs in privacy, and the noise a target epsilon needs.

`accountant` the run's `Accountant` (its state and record); `amplified` epsilon of
amplified BandMF (and of a stored event or run) composed with dp-accounting, cached per
process; `calibration` the smallest sigma that meets a target epsilon; `pld_composition`
the k-fold self-composition of one round's PLD, cached, built on `pld_gaussian` (the
one-round PLD) and `_pld_kernels` (compiled replicas of dp-accounting's loops); `method`
the accountant methods as a light enum. A BLT's accounting lives with the BLT
(`cocoon_ckpt.dp.blt.accounting`).

The names below load on first use, so `method` (which the config and the CLI's
`--help` read) is importable without dp-accounting.
"""

from typing import TYPE_CHECKING

from cocoon_ckpt._lazy import attach

if TYPE_CHECKING:  # the names as static tools see them
    from cocoon_ckpt.dp.accounting.accountant import Accountant
    from cocoon_ckpt.dp.accounting.amplified import (
        clear_caches,
        dp_event,
        epsilon,
        epsilon_of_event,
        epsilon_of_run,
    )
    from cocoon_ckpt.dp.accounting.calibration import blt_noise_multiplier, noise_multiplier_for
    from cocoon_ckpt.dp.accounting.method import AccountingMethod

_LAZY = {
    "Accountant": "accountant",
    "AccountingMethod": "method",
    "blt_noise_multiplier": "calibration",
    "clear_caches": "amplified",
    "dp_event": "amplified",
    "epsilon": "amplified",
    "epsilon_of_event": "amplified",
    "epsilon_of_run": "amplified",
    "noise_multiplier_for": "calibration",
}
__all__ = [
    "Accountant",
    "AccountingMethod",
    "blt_noise_multiplier",
    "clear_caches",
    "dp_event",
    "epsilon",
    "epsilon_of_event",
    "epsilon_of_run",
    "noise_multiplier_for",
]
__getattr__, __dir__ = attach(__name__, _LAZY)
