"""Chaos runs: random crash schedules on faulty storage, each run to completion with
resumes and compared with a golden trace; at-rest damage injected between runs. The
runs with real processes (SIGKILL, takeovers on S3) are in `process_chaos`."""

from __future__ import annotations

import dataclasses
import json
import random
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cocoon_ckpt import JobConfig, JobOptions, ResumeAllowances, run_job
from cocoon_ckpt.keys import manifest_mac_key
from state import CorruptVersionError, Store, restamp
from state.paths import manifest_path, version_prefix

from .crash import CrashPointHit, crash_at, disarm_all, known_points
from .faulty_fs import FaultPlan, faulty_filesystem
from .forgery import forge_manifest, forge_random_number
from .trace import Trace, golden

__all__ = ["ChaosReport", "draw_schedule", "run_chaos"]


def checkpoint_steps(steps: int, every: int) -> list[int]:
    """The steps a job of `steps` steps checkpoints at, every `every` and at the end."""
    return sorted({*range(every, steps + 1, every), steps})


def draw_schedule(
    config: JobConfig, n: int, rng: random.Random, points: list[str] | None = None
) -> list[tuple[str, int | None]]:
    """n (crash point, step) pairs at steps where each point really fires: noise and
    trainer points at any step, checkpoint points at checkpoint steps, retention at its
    next deletion (no step), the precompute's at its first tile (no step; only for a job
    that may coalesce its embedding tables). Sorted by step, so an earlier crash does not skip a later."""
    names = sorted(points or known_points())
    emb = config.embedding
    if emb is None or not emb.coalescing_allowed:  # no precompute: its points never fire
        names = [p for p in names if not p.startswith("precompute.")]
    ckpt_steps = checkpoint_steps(config.dp.steps, config.checkpoint_every)
    steps = config.dp.steps
    out: list[tuple[str, int | None]] = []
    for _ in range(n):
        name = rng.choice(names)
        if name.startswith(("retention.", "precompute.")):
            out.append((name, None))  # the next deletion; the precompute's first tile
        elif name.startswith("checkpoint."):
            out.append((name, rng.choice(ckpt_steps)))
        else:
            out.append((name, rng.randrange(steps)))
    return sorted(out, key=lambda p: -1 if p[1] is None else p[1])


@dataclass
class ChaosReport:
    """What a chaos run did and found. `ok` is False on any divergence, lost version
    or undetected corruption."""

    trials: int = 0
    kill_trials: int = 0
    takeover_trials: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    resumes: int = 0
    divergences: int = 0
    lost_versions: int = 0
    detected_corruptions: int = 0
    undetected_corruptions: int = 0
    fenced_writers: int = 0
    unfenced_commits: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.divergences
            or self.lost_versions
            or self.undetected_corruptions
            or self.unfenced_commits
        )

    def table(self) -> str:
        rows = [
            ("trials (in-process, faulty storage)", self.trials),
            ("trials (subprocess, SIGKILL)", self.kill_trials),
            ("trials (S3, a frozen writer taken over)", self.takeover_trials),
            *[(f"faults: {k}", v) for k, v in sorted(self.faults.items())],
            ("resumes", self.resumes),
            ("divergences", self.divergences),
            ("lost committed versions", self.lost_versions),
            ("detected corruptions", self.detected_corruptions),
            ("undetected corruptions", self.undetected_corruptions),
            ("superseded writers refused on waking", self.fenced_writers),
            ("commits by a superseded writer", self.unfenced_commits),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def as_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["faults"] = dict(self.faults)
        d["ok"] = self.ok
        return d


def _corrupt_newest(store: Store, rng: random.Random) -> str | None:
    """Flip one bit in one chunk of the newest version's own arrays (at rest). Only
    when an older version exists to fall back to: with none, the right answer is the
    clear error a resume gives, not a recovery to count."""
    versions = store.versions()
    if len(versions) < 2:
        return None
    man = store.manifest(versions[-1])
    own = [m for m in man.arrays.values() if m.path.startswith(version_prefix(man.version))]
    own = [m for m in own if m.nbytes > 0]
    if not own:
        return None
    meta = rng.choice(own)
    chunks = [p for p in store.backend.find(meta.path) if "/c" in p[len(meta.path) :]]
    chunk = rng.choice(chunks)
    data = bytearray(store.backend.read_bytes(chunk))
    bit = rng.randrange(len(data) * 8)
    data[bit // 8] ^= 1 << (bit % 8)
    store.backend.fs.pipe_file(store.backend.path(chunk), bytes(data))
    return chunk


def _flip_record_bit(store: Store, rng: random.Random) -> str | None:
    """Flip one bit of the newest manifest at rest, anywhere in its bytes (records,
    header, checksums or layout): what a bad sector or a stray write does to metadata."""
    versions = store.versions()
    if len(versions) < 2:
        return None
    path = manifest_path(versions[-1])
    data = bytearray(store.backend.read_bytes(path))
    bit = rng.randrange(len(data) * 8)
    data[bit // 8] ^= 1 << (bit % 8)
    store.backend.fs.pipe_file(store.backend.path(path), bytes(data))
    return f"{path} bit {bit}"


#: Array paths an attacker who can recompute the checksums may write into a manifest:
#: another store's folder, an absolute path, a URL, a folder outside versions/ and shared/.
_HOSTILE_PATHS = (
    "../../other.zarr/versions/00000001-g1/model/{name}",
    "versions/../../other.zarr/{name}",
    "/etc/{name}",
    "s3://elsewhere/run.zarr/versions/00000001-g1/{name}",
    "secret/{name}",
)


def _tamper_path(store: Store, rng: random.Random) -> str | None:
    """Point one array of the newest manifest outside the store and re-stamp every
    checksum, as a writer who can recompute them would: only the path check can catch it."""
    versions = store.versions()
    if len(versions) < 2:
        return None
    path = manifest_path(versions[-1])
    doc = json.loads(store.backend.read_bytes(path))
    name = rng.choice(sorted(doc["arrays"]))
    hostile = rng.choice(_HOSTILE_PATHS).format(name=name.replace("/", "_"))
    doc["arrays"][name]["path"] = hostile
    store.backend.fs.pipe_file(store.backend.path(path), restamp(doc))
    return f"{path}: {name} -> {hostile}"


def _forge(keep_macs: bool) -> Callable[[Store, random.Random], str | None]:
    def forge(store: Store, rng: random.Random) -> str | None:
        """Double one number of the newest manifest's records and re-stamp its
        checksums, as a writer without the key would: only its MACs can catch it."""
        versions = store.versions()
        if len(versions) < 2:
            return None
        what = forge_manifest(store, versions[-1], forge_random_number(rng), keep_macs=keep_macs)
        return f"{manifest_path(versions[-1])}: {what}"

    return forge


#: At-rest damage a trial may inject after a crash, and how each is applied.
_AT_REST = {
    "bit flip at rest (chunk)": _corrupt_newest,
    "bit flip at rest (manifest)": _flip_record_bit,
    "array path out of the store (re-stamped)": _tamper_path,
    "record forged, MACs kept (re-stamped)": _forge(keep_macs=True),
    "record forged, MACs stripped (re-stamped)": _forge(keep_macs=False),
}


def run_chaos(
    config: JobConfig,
    *,
    trials: int,
    seed: int,
    key: bytes | None = None,
    report: ChaosReport | None = None,
) -> ChaosReport:
    """`trials` random fault schedules against `config` on faulty memory:// stores.

    Each trial draws 1-3 crash points (any known point, at a random step), storage
    fault rates (transient errors, lost responses, slow writes) and, with probability
    1/2 after a crash, damage at rest to the newest version: a bit flip in one of its
    chunks, a bit flip anywhere in its manifest, an array path pointed outside the
    store with every checksum re-stamped, or a number of a record forged with every
    checksum re-stamped (its MACs kept or stripped). Each must be detected on open with
    the job's key. It runs the job to
    completion, resuming after each crash, and compares the trace with the golden one.
    """
    import tempfile

    report = ChaosReport() if report is None else report
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        key_file = f"{tmp}/noise.key"
        if key is not None:
            with open(key_file, "wb") as f:
                f.write(key)
        reference = golden(config, f"{tmp}/gold.zarr", options=JobOptions(key_file=key_file))
        with open(key_file, "rb") as f:
            mac_key = manifest_mac_key(f.read())
        for trial in range(trials):
            report.trials += 1
            plan = FaultPlan(
                seed=rng.randrange(2**31),
                transient=rng.choice([0.0, 0.05, 0.2]),
                lost_response=rng.choice([0.0, 0.05]),
                slow=rng.choice([0.0, 0.02]),
                slow_s=0.001,
            )
            fs = faulty_filesystem("memory://", plan)
            url = f"/chaos-{uuid.uuid4().hex}"
            schedule = draw_schedule(config, rng.randint(1, 3), rng)
            trace = Trace()
            newest_seen = 0
            allow_fallback = False
            for point, step in [*schedule, (None, None)]:
                if point is not None:
                    crash_at(point, step=step)
                try:
                    run_job(
                        config,
                        url,
                        on_step=trace.record,
                        options=JobOptions(
                            fs=fs,
                            key_file=key_file,
                            allow=ResumeAllowances(fallback=allow_fallback),
                        ),
                    )
                    done = True
                except CrashPointHit:
                    report.faults[f"crash: {point}"] += 1
                    report.resumes += 1
                    done = False
                finally:
                    disarm_all()
                fs.armed = False
                store = Store.open(url, fs=fs)
                # read as a resume reads it: authenticated by the job's key
                store.authenticate_with(mac_key)
                latest = store.latest(allow_fallback=True)
                step_now = latest.step if latest else 0
                if step_now < newest_seen:
                    report.lost_versions += 1
                    report.failures.append(f"trial {trial}: newest step {step_now} < {newest_seen}")
                newest_seen = max(newest_seen, step_now)
                # at most one at-rest flip a trial: retention keeps only a few versions,
                # and one of them must stay intact to recover from
                if not done and not allow_fallback and rng.random() < 0.5:
                    # in turn, so a short run meets every kind
                    done_kinds = sum(report.faults[k] for k in _AT_REST)
                    kind = sorted(_AT_REST)[done_kinds % len(_AT_REST)]
                    where = _AT_REST[kind](store, rng)
                    if where is not None:
                        report.faults[kind] += 1
                        try:
                            store.latest()
                            report.undetected_corruptions += 1
                            report.failures.append(f"trial {trial}: {where} not detected")
                        except CorruptVersionError:
                            report.detected_corruptions += 1
                            # from now on resume from the newest valid version
                            allow_fallback = True
                            newest_seen = 0
                fs.armed = True
                if done:
                    break
            for kind, n in fs.injected.items():
                report.faults[f"storage: {kind}"] += n
            div = reference.first_divergence(trace)
            if div is not None:
                report.divergences += 1
                report.failures.append(f"trial {trial} {schedule}: {div}")
            fs.target.rm(url, recursive=True)
    return report
