"""What a job's privacy guarantee is about, in words and numbers, from its records.

The one description that export's `OUT.privacy.json`, `audit` and `inspect` print.
Import-light on purpose (no torch, no dp-accounting): `inspect` uses it.
"""

from __future__ import annotations

import math
from typing import Any

from cocoon_ckpt.layout import THREAT_MODEL_DEFAULT, THREAT_MODELS

__all__ = ["NEIGHBOURING_RELATION", "NEIGHBOURING_RELATION_MEANS", "describe"]

#: The adjacency the guarantee holds under (jax_privacy / dp-accounting: REPLACE_SPECIAL).
NEIGHBOURING_RELATION = "zero-out"

NEIGHBOURING_RELATION_MEANS = (
    "two datasets of the same size N are neighbours when one example of one is replaced by "
    "a zero-out example that contributes a zero gradient (replace-one adjacency); the "
    "sampler's seeded equal split into b partitions fixes N, so the guarantee does not "
    "cover adding or removing an example"
)

#: Optimizer hyperparameters worth reporting (torch param_group keys, when present).
_HYPER = (
    "lr",
    "momentum",
    "dampening",
    "nesterov",
    "weight_decay",
    "betas",
    "eps",
    "amsgrad",
    "maximize",
)


def _optimizer(config: dict[str, Any], optimizer: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": config.get("optimizer"), "lr": config.get("lr")}
    groups = (optimizer or {}).get("param_groups")
    if isinstance(groups, list) and groups and isinstance(groups[0], dict):
        out["param_groups"] = [
            {k: g[k] for k in _HYPER if k in g} for g in groups if isinstance(g, dict)
        ]
    return out


def _sigma_means(sigma: float, target: Any, dp: dict[str, Any], planned: int) -> str:
    if target is None:
        return f"sigma={sigma:g} given by the job's config"
    method = str(dp.get("accountant", "pld")).upper()
    return (
        f"sigma={sigma:.6g} calibrated once, when the job started: the smallest sigma >= 0.3 "
        f"whose epsilon after the {planned} planned steps at delta={float(dp['delta']):g} "
        f"is <= target_epsilon={float(target):g} ({method}); recorded in the config and "
        "reused by every resume, never recalibrated"
    )


def describe(
    records: dict[str, Any],
    *,
    steps_done: int,
    epsilon: float | None,
    accounting_method: str,
) -> dict[str, Any]:
    """The guarantee of a version: neighbouring relation, N, expected B, q, sampler,
    optimizer and hyperparameters, epsilon at delta, accounting, steps done / planned,
    threat model, and where sigma came from (given, or calibrated for a target epsilon).

    Args:
        records: a manifest's records (config, optimizer, threat_model, mechanism).
        steps_done: the verified step count of the version.
        epsilon: epsilon after `steps_done` steps (the caller says whether it was
            recomputed or read from the record).
        accounting_method: `pld` or `rdp`.

    Raises:
        KeyError, TypeError, ValueError: the config record is missing or malformed.
    """
    config = records["config"]
    dp = config["dp"]
    n_data, batch, bands = int(dp["dataset_size"]), int(dp["batch_size"]), int(dp["bands"])
    planned = int(dp["steps"])
    q = batch * bands / n_data
    tm = records.get("threat_model", THREAT_MODEL_DEFAULT)
    rounds = math.ceil(steps_done / bands)
    sigma, target = float(dp["noise_multiplier"]), dp.get("target_epsilon")
    return {
        "epsilon": epsilon,
        "delta": float(dp["delta"]),
        "neighbouring_relation": NEIGHBOURING_RELATION,
        "neighbouring_relation_means": NEIGHBOURING_RELATION_MEANS,
        "dataset_size": n_data,
        "expected_batch_size": batch,
        "sampling_rate": q,
        "sampler": {
            "kind": "cyclic_poisson",
            "partitions": bands,
            "seed": dp.get("seed"),
            "means": f"the N={n_data} examples are split once by a seeded permutation into "
            f"b={bands} equal partitions; step t samples partition t mod b, each of its "
            f"examples independently with probability q = B b / N = {q:.6g} "
            f"(expected batch B={batch})",
        },
        "optimizer": _optimizer(config, records.get("optimizer")),
        "mechanism": records.get("mechanism", {}).get("mechanism", dp.get("mechanism")),
        "bands": bands,
        "noise_multiplier": sigma,
        "target_epsilon": None if target is None else float(target),
        "noise_multiplier_means": _sigma_means(sigma, target, dp, planned),
        "max_grad_norm": float(dp["max_grad_norm"]),
        "accounting_method": accounting_method,
        "accounting": _accounting(records, q, rounds, accounting_method, sigma, bands),
        "steps": steps_done,
        "steps_planned": planned,
        "complete": steps_done == planned,
        "threat_model": tm,
        "threat_model_means": THREAT_MODELS.get(tm, "unknown threat model"),
        "not_covered": "the stored training metrics (each step's loss, the clipped "
        "gradient's norm, what the loop logged) are computed from the private data without "
        "noise: the guarantee covers the model and the noise state, not them; do not "
        "release a store's metrics record as private output",
    }


def _accounting(
    records: dict[str, Any], q: float, rounds: int, method: str, sigma: float, bands: int
) -> str:
    """How epsilon was composed, in words: amplified BandMF, or a BLT's one Gaussian."""
    if records.get("mechanism", {}).get("kind") == "BLT":
        sens = records.get("accountant", {}).get("sensitivity")
        return (
            f"BLT: one Gaussian mechanism with noise multiplier sigma / sensitivity = "
            f"{sigma} / {sens} over the whole run (the sensitivity of C under "
            f"{bands}-min-separated participation); no amplification by sampling, since "
            "C is not banded; exact at the last step, an upper bound before it "
            f"(dp-accounting {method.upper()}; under zero-out adjacency)"
        )
    return (
        f"amplified BandMF: Poisson-subsampled Gaussian with q = B b / N = {q:.6g}, "
        f"composed ceil(n / b) = {rounds} times (dp-accounting {method.upper()}; under "
        "zero-out adjacency)"
    )
