"""Export a finished job's model and its privacy report; read a store's recorded config.

Nothing is trusted that can be derived (I7): "finished" is the verified step count
against the verified config (never the stored `complete` flag), epsilon is recomputed
from the config, and the fingerprint is recomputed from the config and shapes. The two
output files appear together or not at all, never inside the store. A coalesced CSC
that its job read in windows, or a large one, is verified one chunk at a time, never
held (`tools.csc_reads`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import tempfile
from typing import Any

import torch

from cocoon_ckpt._state_dict import plain_keys
from cocoon_ckpt.dp.accounting.amplified import epsilon_of_run
from cocoon_ckpt.dp.accounting.method import AccountingMethod
from cocoon_ckpt.errors import ConfigError, RequestError
from cocoon_ckpt.format.fingerprint import fingerprint
from cocoon_ckpt.format.stored import model_state, newest_records
from cocoon_ckpt.keys import load_key, manifest_mac_key, read_key_file, sealed_under, wrong_key
from cocoon_ckpt.layout import KEY_SECRET, THREAT_MODEL_DEFAULT
from cocoon_ckpt.tools.csc_reads import verify_version
from cocoon_ckpt.tools.guarantee import describe
from cocoon_ckpt.train.config import JobConfig
from state import CorruptVersionError, Store, StoreError, UnauthenticatedVersionError, Version
from state.paths import manifest_path

__all__ = ["REPORT_SUFFIX", "ExportPathError", "export_model", "read_config"]


def read_config(store_url: str, storage_options: dict[str, Any] | None = None) -> JobConfig:
    """The JobConfig recorded in a store's newest version."""
    return JobConfig.from_record(newest_records(store_url, storage_options)["config"])


#: The privacy report lies beside the model: `<out>` + this.
REPORT_SUFFIX = ".privacy.json"


class ExportPathError(RequestError, ValueError):
    """`export --out` names a path export must not write: inside the store, in a
    missing folder, or a file that already exists."""


def _damaged(version: Version, what: str) -> CorruptVersionError:
    return CorruptVersionError(
        f"version {version.version} of {version.store.url}: {what}; run `cocoon-ckpt audit` "
        "on the store",
        version=version.version,
        path=manifest_path(version.version),
    )


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _key(store: Store, key_file: str | None) -> bytes | None:
    """The job's key where it can be had: the key file given, else the store's own."""
    if key_file is not None:
        return read_key_file(key_file)
    if store.get_secret(KEY_SECRET) is None:
        return None
    return load_key(store, None)


def _refuse_nonfinite(model: dict[str, torch.Tensor], store_url: str, version: int) -> None:
    """Refuse a model with a NaN or inf parameter or buffer: a model that diverged (or a
    store written before the trainer refused non-finite gradients) is no model to release.

    Raises:
        StoreError: naming the version and the tensors.
    """
    bad = [k for k, v in model.items() if v.is_floating_point() and not bool(v.isfinite().all())]
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise StoreError(
            f"{store_url}: the model of version {version} holds non-finite values (NaN or "
            f"inf) in {shown}: export refuses to release it; retrain from a version whose "
            "model is finite"
        )


def _check_out(store: Store, out: str) -> tuple[str, str]:
    """The model and report paths, after every check that can refuse them."""
    report = out + REPORT_SUFFIX
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise ExportPathError(
            f"--out {out}: folder {folder} does not exist; create it first (mkdir -p {folder})"
        )
    if store.backend.local:
        root = os.path.realpath(store.backend.path(""))
        for p in (out, report):
            # realpath follows a link at the last component too: a link into the store
            # is as dangerous as a path inside it
            if _inside(os.path.realpath(p), root):
                raise ExportPathError(
                    f"--out {out}: {p} lies inside the store {store.url}, where it could "
                    "overwrite the noise key or history; choose a path outside the store"
                )
    for p in (out, report):
        if os.path.lexists(p):
            raise ExportPathError(
                f"--out {out}: {p} already exists; export writes a new model and report "
                "pair: remove the old pair or choose another --out"
            )
    return out, report


def _write_temp(folder: str, name: str, write: Any) -> str:
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def _publish(tmp: str, path: str) -> None:
    """Create `path` as `tmp`'s content, refusing to replace an existing file."""
    try:
        os.link(tmp, path)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        # no hard links on this file system: rename, after the existence check above
        os.rename(tmp, path)


def _write_pair(model: dict[str, torch.Tensor], report: dict[str, Any], out: str) -> None:
    """Both files or neither: temps written and fsynced first, then linked in, the report
    first (a report without its model releases nothing); a failed second link removes
    the first."""
    folder = os.path.dirname(os.path.abspath(out))
    base = os.path.basename(out)
    temps: list[str] = []
    published: list[str] = []
    try:
        temps.append(_write_temp(folder, base, lambda f: torch.save(model, f)))
        doc = json.dumps(report, indent=1).encode()
        temps.append(_write_temp(folder, base + REPORT_SUFFIX, lambda f: f.write(doc)))
        for tmp, path in ((temps[1], out + REPORT_SUFFIX), (temps[0], out)):
            _publish(tmp, path)
            published.append(path)
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        for p in published:
            with contextlib.suppress(OSError):
                os.unlink(p)
        raise
    finally:
        for tmp in temps:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def export_model(
    store_url: str,
    out: str,
    *,
    storage_options: dict[str, Any] | None = None,
    allow_incomplete: bool = False,
    key_file: str | None = None,
    allow_unauthenticated: bool = False,
) -> dict[str, Any]:
    """Write the final model's state_dict (no noise state) to `out` and its privacy
    report to `out + ".privacy.json"`, both or neither. Its keys are those of the plain
    model: a job trained with a `torch.compile`d model exports without `_orig_mod.`.

    Args:
        store_url: the job's store.
        out: a new file outside the store, in an existing folder.
        storage_options: fsspec options for the store URL.
        allow_incomplete: export an unfinished job (never under threat model
            final_model, whose cold rows lack their pending noise until the end).
        key_file: the job's key file, when the key is not kept in the store: with the
            key (from either place) the version exported is authenticated by its MACs,
            so its step count and records are the job's own; without it only the
            unkeyed checksums vouch for them, the report says so, and a final_model
            job is refused (its completeness is what makes it releasable).
        allow_unauthenticated: export a version without MACs (written before store
            format 4) although the key is at hand.

    Returns:
        The privacy report (see `cocoon_ckpt.tools.guarantee.describe`), with `source`.

    Raises:
        ExportPathError: `out` lies inside the store, its folder is missing, or it or
            its report already exists. Checked before anything is read or written.
        StoreError: the store has no version, the job is unfinished, or its model holds
            NaN or inf values.
        CorruptVersionError: the newest version fails verification, or its records
            contradict what they can be recomputed from (fingerprint, epsilon, shapes).
    """
    store = Store.open(store_url, storage_options=storage_options, create=False)
    out, report_path = _check_out(store, out)
    key = _key(store, key_file)
    if key is not None:
        store.authenticate_with(manifest_mac_key(key), require=not allow_unauthenticated)
    try:
        # the arrays are verified here, not by latest(): a CSC read in windows (or a
        # large one) is verified one chunk at a time instead of held whole
        latest = store.latest(verify=False)
        if latest is not None:
            verify_version(latest)
    except CorruptVersionError as exc:
        wrong = wrong_key(store, key) if key is not None else None
        if wrong is not None:
            raise wrong from None
        stripped = key is not None and sealed_under(store, key, below=exc.version) is not None
        if isinstance(exc, UnauthenticatedVersionError) and not stripped:
            exc.args = (
                f"{exc}; if cocoon-ckpt before store format 4 wrote it and no one else can "
                "write the store, pass --allow-unauthenticated (export_model(allow_unauthenticated=True))",
            )
        raise
    if latest is None:
        raise StoreError(f"{store_url} has no committed version to export; run the job first")
    rec = latest.records
    try:
        config = JobConfig.from_record(rec["config"])
        fp = fingerprint(rec["config"], rec["model_shapes"], rec.get("identity"))
        acc = rec["accountant"]
        method = AccountingMethod(acc.get("method", "pld"))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _damaged(latest, f"the config or accountant record cannot be read ({exc})") from None
    dp = config.dp
    done, planned = latest.step, dp.steps
    if done > planned:
        raise _damaged(latest, f"the version is at step {done}, beyond the config's {planned}")
    if rec.get("fingerprint") != fp:
        raise _damaged(latest, f"recorded fingerprint {rec.get('fingerprint')} is not {fp}")
    finished = done == planned
    tm = rec.get("threat_model", THREAT_MODEL_DEFAULT)
    if tm == "final_model" and not finished:
        raise StoreError(
            f"{store_url}: threat model final_model and the job is at step {done} of "
            f"{planned}: cold embedding rows of an unfinished job lack their pending noise, "
            "so this model must not be released. Finish the job, then export"
        )
    # A key kept in the store vouches against corruption only: whoever can write the
    # store can plant a key there and re-seal every version with it.
    authenticated = key_file is not None and latest.manifest.sealed
    if tm == "final_model" and not authenticated:
        raise StoreError(
            f"{store_url}: threat model final_model, and version {latest.version} is not "
            "authenticated by a key file kept apart from the store (pass --key-file / "
            "key_file=; a key in the store can be planted by its writers), so its step "
            "count cannot be trusted to say the job finished: export refuses to release it"
        )
    if not finished and not allow_incomplete:
        raise StoreError(
            f"{store_url}: the job is at step {done} of {planned}; export needs a finished "
            "job (finish it, or pass allow_incomplete=True)"
        )
    model = model_state(latest)
    shapes = {k: list(v.shape) for k, v in model.items()}
    if shapes != rec["model_shapes"]:
        raise _damaged(latest, "the model arrays' shapes differ from the recorded model shapes")
    try:
        # versions written before JobParts unwrapped compiled models name their
        # parameters `_orig_mod.<name>`, which the plain model does not load
        model = plain_keys(model, f"the model of version {latest.version}")
    except ConfigError as exc:
        raise _damaged(latest, str(exc)) from None
    _refuse_nonfinite(model, store_url, latest.version)
    eps = (
        epsilon_of_run(rec["config"]["dp"], rec.get("mechanism"), done, method.value)
        if done > 0
        else 0.0
    )
    stored = acc.get("epsilon")
    # a version written mid-run stores only its accounting event (None here): the
    # recomputed epsilon is what the report carries either way
    if (
        done > 0
        and stored is not None
        and not (isinstance(stored, (int, float)) and math.isclose(stored, eps, rel_tol=1e-9))
    ):
        raise _damaged(
            latest,
            f"stored epsilon {stored!r} differs from {eps!r} recomputed from the config for "
            f"{done} steps",
        )
    target = dp.target_epsilon
    if target is not None:
        planned_eps = (
            eps
            if finished
            else epsilon_of_run(rec["config"]["dp"], rec.get("mechanism"), planned, method.value)
        )
        if not planned_eps <= target * (1 + 1e-9):
            raise _damaged(
                latest,
                f"the recorded noise_multiplier={dp.noise_multiplier!r} gives epsilon "
                f"{planned_eps:.6g} after {planned} steps, above the recorded "
                f"target_epsilon={target!r}: the config was altered after calibration",
            )
    report = describe(rec, steps_done=done, epsilon=eps, accounting_method=method.value)
    report["source"] = {
        "store": store_url,
        "version": latest.version,
        "fingerprint": fp,
        "authenticated": authenticated,
        "authenticated_means": (
            "the version's MACs verified under the key file given: its records are the job's own"
            if authenticated
            else "not verified with a key file kept apart from the store (none given, the key "
            "kept in the store, or a version written before store format 4): only what the "
            "store itself holds vouches for the records, and anyone who can write the store "
            "can recompute that"
        ),
    }
    _write_pair(model, report, out)
    return report
