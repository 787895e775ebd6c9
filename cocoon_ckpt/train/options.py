"""How a job is run against its store, as one value `run_job` and `open_job` take:
where the key is kept, how the store is reached, the resume checks lifted. Nothing here
changes what the job computes (the config does), so none of it is fingerprinted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.format.snapshot import LENT_ROW_POLICIES, LentRowPolicy
from cocoon_ckpt.train.allowances import ResumeAllowances

__all__ = ["JobOptions"]


@dataclass(frozen=True, kw_only=True, slots=True)
class JobOptions:
    """The options of one run of a job against its store.

    Attributes:
        key_file: Keep the noise key in this file (0600) instead of the store; a resume
            reads it there. Two runs compared for bit-identity share one key file.
        storage_options: fsspec options for the store's URL (credentials, endpoint_url).
        fs: An fsspec filesystem to reach the store through (fault injection).
        takeover: Take the writer lease even if its holder looks alive.
        allow: The resume checks to lift, each at the cost its field states; the only
            way to lift one.
        on_precompute: Called as (rows done, rows in all) while coalesced embedding noise
            is precomputed (a fresh start only; a resume loads it).
        lent_rows: What a step does when it must overwrite a ring row that the checkpoint
            being written has not written yet: "wait" (default) for the writer, which
            writes that row next (no row copied unless the writer has not begun it
            within `format.snapshot.LENT_ROW_WAIT_S`, 2 s), or "copy" it out at once
            (one ring row of memory held until the version is written; the step does
            not wait for the disk). The stored bytes are the same either way
            (`Checkpointer`'s `lent_rows`).
    """

    key_file: str | None = None
    storage_options: dict[str, Any] | None = None
    fs: Any = None
    takeover: bool = False
    allow: ResumeAllowances = ResumeAllowances()
    on_precompute: Callable[[int, int], None] | None = None
    lent_rows: LentRowPolicy = "wait"

    def __post_init__(self) -> None:
        if self.key_file is not None and (not isinstance(self.key_file, str) or not self.key_file):
            raise ConfigError(
                f"JobOptions.key_file={self.key_file!r} is not a path; give the key file's "
                "path as a non-empty string, or None to keep the key in the store"
            )
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise ConfigError(
                f"JobOptions.storage_options={self.storage_options!r} is not a dict; pass "
                "fsspec's options as a dict, or None"
            )
        if type(self.takeover) is not bool:
            raise ConfigError(
                f"JobOptions.takeover={self.takeover!r} is not a bool; pass True or False"
            )
        if not isinstance(self.allow, ResumeAllowances):
            raise ConfigError(
                f"JobOptions.allow={self.allow!r} is not a ResumeAllowances; pass "
                "ResumeAllowances(fallback=True, ...) for the checks to lift"
            )
        if self.on_precompute is not None and not callable(self.on_precompute):
            raise ConfigError(
                f"JobOptions.on_precompute={self.on_precompute!r} is not callable; pass a "
                "function of (rows done, rows in all), or None"
            )
        if self.lent_rows not in LENT_ROW_POLICIES:
            raise ConfigError(
                f'JobOptions.lent_rows={self.lent_rows!r} is not a policy; pass "copy" '
                '(a ring row copied out while a checkpoint is written) or "wait" (the '
                "step waits for the writer instead)"
            )
