"""The job fingerprint and the resume compatibility check: which config fields change the
noise or the parameters, their digest, and the differences a resume is refused for.

It works on config records (`JobConfig.to_record()`), so readers that never build a
config (audit, export) compute the same fingerprint the writer stored.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from cocoon_ckpt.errors import ConfigMismatchError

__all__ = [
    "HARMLESS_FIELDS",
    "HARMLESS_SECTIONS",
    "check_resume",
    "config_differences",
    "fingerprint",
]

#: Fields a resume may change: they affect neither the noise nor the parameters
#: (`grad_threads` would, but a resume runs at the count its record holds and refuses
#: another explicit one: `train.grad_threads`).
HARMLESS_FIELDS = frozenset(
    {
        "checkpoint_every",
        "keep_last",
        "async_checkpoint",
        "log_level",
        "tile_rows",
        "csc_window_steps",
        "overlap_noise",
        "grad_threads",
        "lease_expiry_s",
    }
)

#: Whole sections a resume may change: where the history lives never changes the noise.
HARMLESS_SECTIONS = frozenset({"tiers"})

#: Sections and fields added after the first release, with the value their absence from
#: an older record means: at that value they are left out, so older stores keep their
#: fingerprints and resume.
_ADDED = {
    "embedding": None,
    "dp.physical_batch_size": None,
    "dp.noise_rng": "default",
    "dp.clipping": "vmap",
    "dp.target_epsilon": None,
    "dp.accountant": "pld",
}


#: Where the job's free-form options sit in the flat record: each option is one leaf,
#: whatever its key (one named `keep_last` is still the job's) or value (a dict option is
#: compared whole, so `{"a": {}}` differs from `{}`).
_OPTIONS = "options."


def _flat(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in record.items():
        if prefix == _OPTIONS:
            # a scalar option flattens as it always did (older stores keep their
            # fingerprints); a nested one becomes one canonical JSON leaf
            out[f"{prefix}{k}"] = json.dumps(v, sort_keys=True) if isinstance(v, dict) else v
        elif isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _harmless(k: str) -> bool:
    if k.startswith(_OPTIONS):
        return False
    return k.split(".")[-1] in HARMLESS_FIELDS or k.split(".")[0] in HARMLESS_SECTIONS


def _relevant(record: dict[str, Any]) -> dict[str, Any]:
    flat = _flat(record)
    # The accountant changes the noise only through the calibration of sigma for a
    # target epsilon; without a target it only changes the reported epsilon, a view of
    # the same run that a resume may change.
    calibrated = flat.get("dp.target_epsilon") is not None
    return {
        k: v
        for k, v in flat.items()
        if not _harmless(k)
        and not (k in _ADDED and v == _ADDED[k])
        and (k != "dp.accountant" or calibrated)
    }


def fingerprint(
    record: dict[str, Any],
    model_shapes: dict[str, list[int]],
    identity: dict[str, Any] | None = None,
) -> str:
    """sha256 over the fields that change the noise or the parameters, the shapes, and
    (given) the job's identity from its real objects (`train.identity`: optimizer,
    scheduler, dataset); without it, the fingerprint of stores written before it.

    A calibrated config counts both its target epsilon (with the accountant that
    calibrated it) and the sigma it gave: the record says what was asked and what ran."""
    doc: dict[str, Any] = {"config": _relevant(record), "model_shapes": model_shapes}
    if identity is not None:
        doc["identity"] = identity
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _shown(relevant: dict[str, Any], k: str) -> Any:
    """A field's value in a difference: an added field left out means its default."""
    return relevant.get(k, _ADDED[k] if k in _ADDED else "<absent>")


def config_differences(
    stored: dict[str, Any],
    now: dict[str, Any],
    stored_shapes: dict[str, list[int]] | None = None,
    now_shapes: dict[str, list[int]] | None = None,
) -> list[str]:
    """One line per noise- or result-affecting difference between two config records."""
    a, b = _relevant(stored), _relevant(now)
    diffs = [
        f"{k}: stored {_shown(a, k)!r}, now {_shown(b, k)!r}"
        for k in sorted(set(a) | set(b))
        if json.dumps(a.get(k)) != json.dumps(b.get(k))  # 1 == True, but not as JSON
    ]
    if stored_shapes is not None and now_shapes is not None and stored_shapes != now_shapes:
        for k in sorted(set(stored_shapes) | set(now_shapes)):
            if stored_shapes.get(k) != now_shapes.get(k):
                diffs.append(
                    f"model shape {k}: stored {stored_shapes.get(k)}, now {now_shapes.get(k)}"
                )
    return diffs


def check_resume(
    stored: dict[str, Any],
    now: dict[str, Any],
    stored_shapes: dict[str, list[int]],
    now_shapes: dict[str, list[int]],
    where: str,
) -> None:
    """Raise ConfigMismatchError listing every difference that would change the noise."""
    diffs = config_differences(stored, now, stored_shapes, now_shapes)
    if diffs:
        raise ConfigMismatchError(
            f"{where} was written by a job with another configuration; resuming would add "
            "different noise. Differences: " + "; ".join(diffs) + ". Use the stored "
            "configuration, or a new store for the new job",
            diffs,
        )
