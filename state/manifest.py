"""The commit record of one version: written last, its exclusive creation is the commit."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .errors import CorruptVersionError, FormatVersionError

__all__ = ["FORMAT_VERSION", "ArrayMeta", "Manifest", "manifest_path"]

FORMAT_VERSION = 1
_KIND = "cocoon-ckpt/manifest"


def manifest_path(version: int) -> str:
    """Store-relative path of version `version`'s manifest (zero padded: lists in order)."""
    return f"manifests/{version:08d}.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class ArrayMeta:
    """Where one array of a version lies and how to verify it."""

    path: str
    """Store-relative zarr array path (under versions/<v>-g<gen>/ or shared/)."""
    shape: tuple[int, ...]
    """Array shape."""
    dtype: str
    """numpy dtype string, e.g. `float32`."""
    checksum: str
    """`crc32c:xxxxxxxx` of the C-order bytes."""
    chunks: tuple[int, ...] | None = None
    """Chunk shape as written (None: read it from the array's zarr.json)."""

    @property
    def nbytes(self) -> int:
        import numpy as np

        n = 1
        for s in self.shape:
            n *= s
        return n * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "checksum": self.checksum,
            **({"chunks": list(self.chunks)} if self.chunks is not None else {}),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ArrayMeta:
        return cls(
            path=str(d["path"]),
            shape=tuple(int(s) for s in d["shape"]),
            dtype=str(d["dtype"]),
            checksum=str(d["checksum"]),
            chunks=tuple(int(c) for c in d["chunks"]) if "chunks" in d else None,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """Everything needed to read version `version` back, and nothing secret."""

    version: int
    """Version number, parent + 1."""
    step: int
    """Training steps completed when the version was taken."""
    parent: int | None
    """The version this one was built on (for incremental references)."""
    created: str
    """ISO-8601 UTC time of the commit."""
    write_id: str
    """Random id of the commit attempt: tells our own lost-response success from a conflict."""
    writer: dict[str, Any]
    """Owner and lease generation of the writer."""
    job_fingerprint: str | None
    """Fingerprint of the noise-affecting configuration."""
    arrays: dict[str, ArrayMeta] = field(default_factory=dict)
    """Logical name -> array location and checksum."""
    records: dict[str, Any] = field(default_factory=dict)
    """Small JSON records (sampler, accountant, config, ring layout, ...)."""

    def to_bytes(self) -> bytes:
        doc = {
            "kind": _KIND,
            "format_version": FORMAT_VERSION,
            "version": self.version,
            "step": self.step,
            "parent": self.parent,
            "created": self.created,
            "write_id": self.write_id,
            "writer": self.writer,
            "job_fingerprint": self.job_fingerprint,
            "arrays": {k: v.to_json() for k, v in sorted(self.arrays.items())},
            "records": self.records,
        }
        return json.dumps(doc, sort_keys=True, indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, version: int, where: str) -> Manifest:
        """Parse a manifest.

        Raises:
            CorruptVersionError: not valid JSON, not a manifest, or the wrong version.
            FormatVersionError: written by a newer format than this library reads.
        """
        path = manifest_path(version)
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptVersionError(
                f"version {version} of {where}: manifest {path} is not valid JSON "
                f"({exc}); it is torn or damaged",
                version=version,
                path=path,
            ) from exc
        if not isinstance(doc, dict) or doc.get("kind") != _KIND:
            raise CorruptVersionError(
                f"version {version} of {where}: {path} is not a cocoon-ckpt manifest",
                version=version,
                path=path,
            )
        fv = doc.get("format_version")
        if not isinstance(fv, int) or fv > FORMAT_VERSION:
            raise FormatVersionError(
                f"version {version} of {where}: manifest format {fv!r} is newer than this "
                f"library reads ({FORMAT_VERSION}); upgrade cocoon-ckpt"
            )
        try:
            m = cls(
                version=int(doc["version"]),
                step=int(doc["step"]),
                parent=None if doc["parent"] is None else int(doc["parent"]),
                created=str(doc["created"]),
                write_id=str(doc["write_id"]),
                writer=dict(doc["writer"]),
                job_fingerprint=doc.get("job_fingerprint"),
                arrays={k: ArrayMeta.from_json(v) for k, v in doc["arrays"].items()},
                records=dict(doc["records"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptVersionError(
                f"version {version} of {where}: manifest {path} lacks or mangles field {exc}",
                version=version,
                path=path,
            ) from exc
        if m.version != version:
            raise CorruptVersionError(
                f"version {version} of {where}: manifest {path} claims version {m.version}",
                version=version,
                path=path,
            )
        return m
