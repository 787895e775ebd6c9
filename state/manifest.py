"""The commit record of one version: written last, its exclusive creation is the commit.

A manifest verifies itself. Every record carries a sha256 of its canonical JSON
(`record_checksums`), and `header_checksum` covers everything else (version, step,
parent, writer, job fingerprint, the arrays table and the record checksums); the stored
bytes must also equal the canonical serialisation, so even a change that parses to the
same values (`1e-05` -> `1E-05`) is caught. Array paths must stay inside the store.

Checksums find damage, not forgery: whoever can write the store can edit a record and
re-stamp them. A manifest sealed with a MAC key (format 4, `seal`) also carries a keyed
BLAKE2b per record (`record_macs`) and one over the header (`header_mac`, which covers
the record MACs and checksums and every array's checksum); `authenticate` verifies
them with the key and names the record that fails. `state` treats the key as opaque
bytes: cocoon_ckpt derives it from the job's noise key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .canonical_json import canonical_text, load_bounded
from .errors import (
    CorruptVersionError,
    ForgedVersionError,
    FormatVersionError,
    UnauthenticatedVersionError,
    UnsafePathError,
)
from .paths import manifest_path, unsafe_path_reason

__all__ = [
    "FORMAT_VERSION",
    "MAC_KEY_BYTES",
    "ArrayMeta",
    "Manifest",
    "ManifestMacs",
    "manifest_path",
    "restamp",
    "unsafe_path_reason",
]

#: 2: record and header checksums, canonical bytes, confined array paths.
#: 3: an array may record `chunk_key_separator` "." (its chunks `c.0.0`, no folders).
#: 4: a manifest may carry MACs (`record_macs`, `header_mac`): see `Manifest.seal`.
FORMAT_VERSION = 4
#: The manifest formats this library reads.
READ_FORMATS = (2, 3, 4)
_KIND = "cocoon-ckpt/manifest"
_CHECKSUMS = ("header_checksum", "record_checksums", "header_mac", "record_macs")
#: Bytes of a MAC key (BLAKE2b takes up to 64; 32 is its full strength at 256 bits).
MAC_KEY_BYTES = 32
_MAC = "blake2b-256"
# BLAKE2b personalisations (16 bytes at most): a record's MAC and the header's can never
# stand in for one another, nor for any other keyed hash of the same key.
_PERSON_RECORD = b"cc-manifest-rec"
_PERSON_HEADER = b"cc-manifest-hdr"


@dataclass(frozen=True, kw_only=True, slots=True)
class ArrayMeta:
    """Where one array of a version lies and how to verify it.

    Attributes:
        path: Store-relative zarr array path (under versions/<v>-g<gen>/ or shared/).
        shape: Array shape.
        dtype: numpy dtype string, e.g. `float32`.
        checksum: `crc32c:xxxxxxxx` of the C-order bytes.
        chunks: Chunk shape as written (None: read it from the array's zarr.json).
        separator: Its chunk key separator: "/" (`c/0/0`, format 2) or "." (`c.0.0`, format 3).
            Recorded (as `chunk_key_separator`) only when it is ".", so a format-2 array's entry
            reads back to the same canonical bytes.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    checksum: str
    chunks: tuple[int, ...] | None = None
    separator: str = "/"

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
            **({"chunk_key_separator": self.separator} if self.separator != "/" else {}),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ArrayMeta:
        return cls(
            path=str(d["path"]),
            shape=tuple(int(s) for s in d["shape"]),
            dtype=str(d["dtype"]),
            checksum=str(d["checksum"]),
            chunks=tuple(int(c) for c in d["chunks"]) if "chunks" in d else None,
            separator=_separator(d.get("chunk_key_separator", "/")),
        )


def _separator(value: object) -> str:
    if value not in ("/", "."):
        raise ValueError(f"chunk_key_separator {value!r} is neither '/' nor '.'")
    return str(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """Everything needed to read version `version` back, and nothing secret.

    Attributes:
        version: Version number, parent + 1.
        step: Training steps completed when the version was taken.
        parent: The version this one was built on (for incremental references).
        created: ISO-8601 UTC time of the commit.
        write_id: Random id of the commit attempt: tells our own lost-response success from a
            conflict.
        writer: Owner and lease generation of the writer.
        job_fingerprint: Fingerprint of the noise-affecting configuration.
        arrays: Logical name -> array location and checksum.
        records: Small JSON records (sampler, accountant, config, ring layout, ...).
        format_version: The format it was written in (one of `READ_FORMATS`); its bytes keep it.
        macs: The MACs it was sealed with (format 4), as stored; None for an unsealed one.
    """

    version: int
    step: int
    parent: int | None
    created: str
    write_id: str
    writer: dict[str, Any]
    job_fingerprint: str | None
    arrays: dict[str, ArrayMeta] = field(default_factory=dict)
    records: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    macs: ManifestMacs | None = None

    @property
    def sealed(self) -> bool:
        """Whether it carries MACs (which only `authenticate` with the key verifies)."""
        return self.macs is not None

    def to_bytes(self) -> bytes:
        """The canonical bytes, checksums (and stored MACs) included: the same values
        give the same bytes."""
        return _seal(self._body(), None, self.macs)

    def seal(self, mac_key: bytes) -> tuple[Manifest, bytes]:
        """This manifest MACed with `mac_key` (format 4): the sealed manifest and its
        canonical bytes."""
        _check_mac_key(mac_key)
        body = self._body()
        body["format_version"] = FORMAT_VERSION
        data = _seal(body, mac_key, None)
        doc = json.loads(data)
        macs = ManifestMacs(header=doc["header_mac"], records=dict(doc["record_macs"]))
        return replace(self, format_version=FORMAT_VERSION, macs=macs), data

    def authenticate(self, mac_key: bytes, *, where: str) -> None:
        """Verify its MACs with `mac_key`.

        Raises:
            UnauthenticatedVersionError: it carries no MACs (written before format 4, or
                without a key, or they were stripped).
            ForgedVersionError: a record's MAC or the header's fails: it was written by
                someone without the key; `record` names the record (or `"header"`).
        """
        _check_mac_key(mac_key)
        path = manifest_path(self.version)
        if self.macs is None:
            raise UnauthenticatedVersionError(
                f"version {self.version} of {where}: manifest {path} carries no MAC, so "
                "the job's key cannot vouch for it (written by cocoon-ckpt before store "
                "format 4, or its MACs were stripped)",
                version=self.version,
                path=path,
                record="header",
            )
        doc: dict[str, Any] = json.loads(self.to_bytes())
        expect = _macs(doc, mac_key)
        for name in sorted(set(expect.records) | set(self.macs.records)):
            got = self.macs.records.get(name)
            if got is None or not hmac.compare_digest(got, expect.records.get(name, "")):
                raise ForgedVersionError(
                    f"version {self.version} of {where}: record {name!r} of manifest {path} "
                    "fails its MAC under the job's key: it was written or edited by someone "
                    "without the key (forged), or damaged",
                    version=self.version,
                    path=path,
                    record=name,
                )
        if not hmac.compare_digest(self.macs.header, expect.header):
            raise ForgedVersionError(
                f"version {self.version} of {where}: the header of manifest {path} (version, "
                "step, parent, writer, job fingerprint, arrays table or record checksums) "
                "fails its MAC under the job's key: it was written or edited by someone "
                "without the key (forged), or damaged",
                version=self.version,
                path=path,
                record="header",
            )

    def _body(self) -> dict[str, Any]:
        return dict(
            {
                "kind": _KIND,
                "format_version": self.format_version,
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
        )

    @classmethod
    def from_bytes(cls, data: bytes, *, version: int, where: str) -> Manifest:
        """Parse and verify a manifest: its checksums, its canonical form, its paths.

        Raises:
            CorruptVersionError: not valid JSON, not a manifest, the wrong version, a
                record or the header fails its checksum, or the bytes are not canonical;
                `record` names the damaged record (or `"header"`).
            UnsafePathError: an array path leaves the store (a CorruptVersionError).
            FormatVersionError: written by a newer format, or by format 1 (no checksums).
        """
        path = manifest_path(version)

        def corrupt(what: str, record: str | None) -> CorruptVersionError:
            return CorruptVersionError(
                f"version {version} of {where}: manifest {path} {what}",
                version=version,
                path=path,
                record=record,
            )

        try:
            doc = load_bounded(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            pos = exc.pos if isinstance(exc, json.JSONDecodeError) else exc.start
            region = _region(data, pos)
            raise corrupt(
                f"is not valid JSON ({exc}, in {_describe_region(region)}); it is torn or damaged",
                region,
            ) from exc
        if not isinstance(doc, dict) or doc.get("kind") != _KIND:
            raise corrupt("is not a cocoon-ckpt manifest", "header")
        fv = doc.get("format_version")
        if not isinstance(fv, int) or fv > max(READ_FORMATS):
            raise FormatVersionError(
                f"version {version} of {where}: manifest format {fv!r} is newer than this "
                f"library reads ({FORMAT_VERSION}); upgrade cocoon-ckpt"
            )
        if fv < min(READ_FORMATS) and not any(k in doc for k in _CHECKSUMS):
            raise FormatVersionError(
                f"version {version} of {where}: manifest format {fv} carries no record "
                f"checksums, so its records cannot be verified; this library reads format "
                f"{min(READ_FORMATS)} and later only: finish the job with the cocoon-ckpt "
                "that wrote it, or start it again in a new store"
            )
        if fv not in READ_FORMATS:  # checksummed, yet of a format that has none
            raise corrupt(f"claims format {fv}, which carries no checksums", "header")
        _verify_checksums(doc, corrupt)
        try:
            m = cls._from_doc(doc)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise corrupt(f"lacks or mangles field {exc}", "header") from exc
        if m.version != version:
            raise corrupt(f"claims version {m.version}", "header")
        canonical = m.to_bytes()
        if canonical != data:
            at = next(
                (i for i, (a, b) in enumerate(zip(data, canonical, strict=False)) if a != b),
                min(len(data), len(canonical)),
            )
            region = _region(data, at)
            raise corrupt(
                f"differs from its canonical form at byte {at} (in "
                f"{_describe_region(region)}): it was altered after it was written",
                region,
            )
        m._check_paths(where)
        return m

    @classmethod
    def from_own_bytes(cls, data: bytes, *, where: str) -> Manifest:
        """The manifest that `from_bytes` would return for `data`, which this process
        made with `to_bytes` (canonical and checksummed by construction): parsed, its
        array paths checked, its checksums and form not verified again. For the
        manifest cache's copy of a version just committed; bytes read from a store
        always go through `from_bytes`."""
        m = cls._from_doc(json.loads(data))
        m._check_paths(where)
        return m

    def _check_paths(self, where: str) -> None:
        for name, meta in self.arrays.items():
            reason = unsafe_path_reason(meta.path)
            if reason is not None:
                raise UnsafePathError(
                    f"version {self.version} of {where}: array {name!r} has path "
                    f"{meta.path!r}, which {reason}; a manifest may name only arrays under "
                    "versions/ and shared/ of its own store, so this version is refused",
                    version=self.version,
                    path=meta.path,
                    array=name,
                )

    @classmethod
    def _from_doc(cls, doc: Mapping[str, Any]) -> Manifest:
        return cls(
            version=int(doc["version"]),
            step=int(doc["step"]),
            parent=None if doc["parent"] is None else int(doc["parent"]),
            created=str(doc["created"]),
            write_id=str(doc["write_id"]),
            writer=dict(doc["writer"]),
            job_fingerprint=doc.get("job_fingerprint"),
            arrays={k: ArrayMeta.from_json(v) for k, v in doc["arrays"].items()},
            records=dict(doc["records"]),
            format_version=int(doc["format_version"]),
            macs=ManifestMacs.from_doc(doc),
        )


@dataclass(frozen=True, slots=True)
class ManifestMacs:
    """A sealed manifest's MACs as stored (`blake2b-256:<hex>` each).

    Attributes:
        header: Over the header: every field but the records, the record MACs and
            checksums included.
        records: Record name -> the MAC of its name and canonical JSON.
    """

    header: str
    records: dict[str, str]

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> ManifestMacs | None:
        header, records = doc.get("header_mac"), doc.get("record_macs")
        if header is None and records is None:
            return None
        if not isinstance(header, str) or not isinstance(records, dict):
            raise ValueError("'header_mac' and 'record_macs' come together")
        if not all(isinstance(v, str) for v in records.values()):
            raise ValueError("'record_macs' holds a value that is not a string")
        return cls(header=header, records={str(k): v for k, v in records.items()})


def restamp(
    doc: Mapping[str, Any], *, keep_macs: bool = False, mac_key: bytes | None = None
) -> bytes:
    """Canonical manifest bytes of `doc` (a parsed manifest, possibly edited) with fresh
    checksums: what a writer who can recompute them would store.

    For tests and tools that simulate such a writer (an attacker who rewrites a record
    and its checksum), and for repairing a manifest by hand. Nothing is validated. Its
    MACs, which only the key's holder can recompute, are dropped; with `keep_macs` kept
    as they were (stale, if `doc` was edited); with `mac_key` recomputed, as the key's
    holder would (a repair, or a test of the checks that run behind the MACs).
    """
    if mac_key is not None:
        _check_mac_key(mac_key)
        body = {k: v for k, v in doc.items() if k not in _CHECKSUMS}
        return _seal({**body, "format_version": FORMAT_VERSION}, mac_key, None)
    macs = ManifestMacs.from_doc(doc) if keep_macs else None
    return _seal({k: v for k, v in doc.items() if k not in _CHECKSUMS}, None, macs)


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _sha256(value: Any) -> str:
    return "sha256:" + hashlib.sha256(_canonical(value)).hexdigest()


def _header(doc: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in ("records", "header_checksum", "header_mac")}


def _check_mac_key(mac_key: bytes) -> None:
    if not isinstance(mac_key, bytes) or len(mac_key) != MAC_KEY_BYTES:
        raise ValueError(f"a manifest MAC key is {MAC_KEY_BYTES} bytes")


def _mac(mac_key: bytes, person: bytes, value: Any) -> str:
    digest = hashlib.blake2b(_canonical(value), key=mac_key, person=person, digest_size=32)
    return f"{_MAC}:{digest.hexdigest()}"


def _macs(doc: Mapping[str, Any], mac_key: bytes) -> ManifestMacs:
    """The MACs `doc` (record_macs included) should carry under `mac_key`."""
    records = {k: _mac(mac_key, _PERSON_RECORD, [k, v]) for k, v in doc["records"].items()}
    header = {**_header(doc), "record_macs": records}
    return ManifestMacs(header=_mac(mac_key, _PERSON_HEADER, header), records=records)


def _seal(body: Mapping[str, Any], mac_key: bytes | None, macs: ManifestMacs | None) -> bytes:
    # A JSON round trip first: tuples become lists and int keys strings, exactly what a
    # reader sees, so the checksums and the layout a reader recomputes are these.
    doc: dict[str, Any] = json.loads(json.dumps(body))
    doc["record_checksums"] = {k: _sha256(v) for k, v in doc["records"].items()}
    if mac_key is not None:
        macs = _macs(doc, mac_key)
    if macs is not None:
        doc["record_macs"] = dict(macs.records)
        doc["header_mac"] = macs.header
    doc["header_checksum"] = _sha256(_header(doc))
    return canonical_text(doc).encode()


def _verify_checksums(
    doc: dict[str, Any], corrupt: Callable[[str, str | None], CorruptVersionError]
) -> None:
    records, sums = doc.get("records"), doc.get("record_checksums")
    if not isinstance(sums, dict) or not isinstance(doc.get("header_checksum"), str):
        raise corrupt("lacks its header or record checksums", "header")
    if _sha256(_header(doc)) != doc["header_checksum"]:
        raise corrupt(
            "header (version, step, parent, writer, job fingerprint, arrays table or record "
            "checksums) fails its checksum: it is damaged",
            "header",
        )
    if not isinstance(records, dict):
        raise corrupt("has no records object", "header")
    # The header verified, so the checksummed names are the true ones: name a missing
    # record by its checksummed name, and say what stands in its place.
    missing, extra = sorted(set(sums) - set(records)), sorted(set(records) - set(sums))
    if missing:
        instead = f" ({', '.join(map(repr, extra))} is there instead)" if extra else ""
        raise corrupt(f"record {missing[0]!r} is missing{instead}: it is damaged", missing[0])
    if extra:
        raise corrupt(f"record {extra[0]!r} is not covered by a checksum: it is damaged", extra[0])
    for name in sorted(records):
        got = _sha256(records[name])
        if got != sums[name]:
            raise corrupt(
                f"record {name!r} fails its checksum ({got} != stored {sums[name]}): it is damaged",
                name,
            )


def _region(data: bytes, pos: int) -> str:
    """The record whose lines hold byte `pos` of a manifest laid out as `to_bytes` lays
    it out (one space per level: records' names at two), or `"header"`."""
    start = data.rfind(b"\n", 0, pos) + 1
    end = data.find(b"\n", pos)
    lines = [*data[:start].split(b"\n")[:-1], data[start : None if end < 0 else end]]
    record = None
    for i, line in enumerate(reversed(lines)):
        indent = len(line) - len(line.lstrip(b" "))
        if i == 0 and indent < 2:
            return "header"
        if indent == 2 and line[2:3] == b'"' and record is None:
            close = line.find(b'"', 3)
            record = line[3:close].decode("ascii", "replace") if close > 0 else None
        elif indent == 1 and line[1:2] == b'"':
            return record if record and line.startswith(b' "records": ') else "header"
    return "header"


def _describe_region(region: str) -> str:
    return "the header" if region == "header" else f"record {region!r}"
