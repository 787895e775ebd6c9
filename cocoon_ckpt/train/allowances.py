"""What a resume may accept that it refuses by default, as one value the start passes
down (`open_job` -> `start_job` -> `prepare_trainer`): the only way to lift a check."""

from __future__ import annotations

from dataclasses import dataclass, fields

from cocoon_ckpt.errors import ConfigError

__all__ = ["ResumeAllowances"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumeAllowances:
    """Refusals of a resume that the user lifts; each costs what its field says.

    Attributes:
        fallback: Resume from an older version when the newest is damaged (the steps after the older
            one run again).
        generator_change: Resume although the fresh noise's generator backend differs from the
            store's (the noise after the resume is another draw: I3, the bit-exact resume, is lost).
        device_change: Resume on another device type than the store's (the same noise; the
            gradients' last bits, so I3, are not).
        unauthenticated: Resume from a version that carries no MAC under the job's key:
            one written by cocoon-ckpt before store format 4 (its next version is
            authenticated). Its records are then trusted on their unkeyed checksums,
            which anyone who can write the store can recompute: allow it only for a
            store you know no one else wrote.
    """

    fallback: bool = False
    generator_change: bool = False
    device_change: bool = False
    unauthenticated: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if type(value) is not bool:
                raise ConfigError(
                    f"ResumeAllowances.{f.name}={value!r} is not a bool; pass True or False"
                )
