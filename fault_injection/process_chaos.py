"""Chaos with real processes: SIGKILLed subprocesses on local disk, and takeovers of a
frozen writer on a local S3 server, each ending in a final model compared bit for bit
with an uninterrupted run's."""

from __future__ import annotations

import json
import random
import uuid
from typing import Any

from state import Store

from .chaos import ChaosReport, checkpoint_steps
from .crash import known_points

__all__ = ["local_s3_server", "run_kill_chaos", "run_takeover_chaos"]


def _export(store: str, out: str, extra: list[str] | None = None) -> dict[str, Any]:
    """`cocoon-ckpt export STORE --out OUT` in a subprocess; the exported state_dict.

    Raises:
        RuntimeError: export failed (its one-line error in the message).
    """
    import subprocess
    import sys

    import torch

    done = subprocess.run(
        [sys.executable, "-m", "cocoon_ckpt", "export", store, "--out", out, *(extra or [])],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"export of {store} exited {done.returncode}: {done.stderr.strip()}")
    return torch.load(out)  # type: ignore[no-any-return]


def _golden_model(cmd: list[str], tmp: str) -> tuple[str, dict[str, Any]]:
    """Run `cmd` (a `cocoon-ckpt train` command) uninterrupted in `tmp` with a new key
    file: (that key file, which every trial shares, and the exported final model)."""
    import subprocess

    key = f"{tmp}/noise.key"
    subprocess.run(
        [*cmd, "--store", f"{tmp}/gold.zarr", "--key-file", key], check=True, capture_output=True
    )
    return key, _export(f"{tmp}/gold.zarr", f"{tmp}/gold.pt")


def run_kill_chaos(
    train_args: list[str], *, trials: int, seed: int, report: ChaosReport | None = None
) -> ChaosReport:
    """`trials` runs of `cocoon-ckpt train <train_args>` in subprocesses on local disk,
    each SIGKILLed at random crash points and random moments, and once sent SIGTERM to
    its whole process group at a random moment (as a scheduler preempts), rerun until
    done; the exported model must equal an uninterrupted run's bit for bit, and the
    newest version must never move backwards. A SIGTERM must end in exit 143 with the
    step it names committed (or, before the job's handlers, in the signal's default
    death) and leave no lease of its own held. `train_args` must not name
    --store/--key-file.
    """
    import os
    import signal
    import subprocess
    import sys
    import tempfile

    import torch

    report = ChaosReport() if report is None else report
    rng = random.Random(seed)
    cmd = [sys.executable, "-m", "cocoon_ckpt", "train", *train_args, "--no-progress"]
    points = sorted(p for p in known_points() if p != "checkpoint.after_manifest_temp")
    points.append("checkpoint.after_manifest_temp")  # fires on local disk only: here it does

    with tempfile.TemporaryDirectory() as tmp:
        key, gold = _golden_model(cmd, tmp)
        for trial in range(trials):
            report.kill_trials += 1
            store = f"{tmp}/t{trial}.zarr"
            run = [*cmd, "--store", store, "--key-file", key]
            newest_seen = 0
            for attempt in range(6):
                env = dict(os.environ)
                timeout: float | None = None
                if attempt == 0:
                    point = rng.choice(points)
                    env["COCOON_CRASH_AT"] = point
                elif attempt < 4:
                    timeout = rng.uniform(1.0, 6.0)
                group = attempt == 1  # SIGTERM to its process group, as schedulers send it
                generation = _lease_generation(store)
                p = subprocess.Popen(
                    run,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    start_new_session=group,
                )
                try:
                    p.wait(timeout=timeout or 600)
                except subprocess.TimeoutExpired:
                    if group:
                        os.killpg(p.pid, signal.SIGTERM)
                    else:
                        p.send_signal(signal.SIGKILL)
                    p.wait()
                if group and p.returncode in (128 + signal.SIGTERM, -signal.SIGTERM):
                    err = p.stderr.read().decode() if p.stderr else ""
                    wrong = _unclean_preemption(store, generation, p.returncode, err)
                    if wrong is not None:
                        report.failures.append(f"kill trial {trial}: {wrong}")
                        report.divergences += 1
                        break
                    report.faults["SIGTERM to the process group"] += 1
                    report.resumes += 1
                elif p.returncode == -signal.SIGKILL:
                    report.faults[
                        "SIGKILL at " + (point if attempt == 0 else "a random moment")
                    ] += 1
                    report.resumes += 1
                elif p.returncode != 0:
                    err = p.stderr.read().decode() if p.stderr else ""
                    report.failures.append(
                        f"kill trial {trial}: train exited {p.returncode}: {err}"
                    )
                    report.divergences += 1
                    break
                opened = Store.open(store)
                latest = opened.latest()
                step_now = latest.step if latest else 0
                if step_now < newest_seen:
                    report.lost_versions += 1
                    report.failures.append(
                        f"kill trial {trial}: newest step {step_now} < {newest_seen}"
                    )
                newest_seen = max(newest_seen, step_now)
                if p.returncode == 0:
                    try:
                        got = _export(store, f"{tmp}/t{trial}.pt")
                    except RuntimeError as exc:
                        report.divergences += 1
                        report.failures.append(f"kill trial {trial}: {exc}")
                        break
                    if not all(torch.equal(gold[k], got[k]) for k in gold):
                        report.divergences += 1
                        report.failures.append(f"kill trial {trial}: final model differs")
                    break
    return report


def _lease_generation(store: str) -> int:
    """The newest lease generation of a local store (0: none yet)."""
    import os

    if not os.path.exists(store):
        return 0
    holder = Store.open(store, create=False).lease_holder()
    return int(holder["generation"]) if holder is not None else 0


def _unclean_preemption(store: str, generation: int, returncode: int, err: str) -> str | None:
    """What a SIGTERMed run left wrong, or None: a lease it took still held, or an exit
    143 whose named step is not the newest version's."""
    import os
    import re
    import signal

    if not os.path.exists(store):
        return None
    opened = Store.open(store, create=False)
    holder = opened.lease_holder()
    if holder is not None and int(holder["generation"]) > generation and not holder["released"]:
        return f"SIGTERM to the process group (exit {returncode}) left its lease held: {err}"
    named = re.search(r"after step (\d+);", err)
    if returncode != -signal.SIGTERM and named is not None:
        latest = opened.latest()
        if latest is None or latest.step != int(named.group(1)):
            got = latest.step if latest is not None else None
            return f"SIGTERM to the process group: {err.strip()} but the newest step is {got}"
    if returncode != -signal.SIGTERM and named is None and "before a checkpoint" not in err:
        return f"SIGTERM to the process group ended with {err.strip()!r}"
    return None


#: Where a takeover trial freezes writer A: mid-step, mid-checkpoint, and inside the
#: commit between its lease check and its manifest (the window fencing must close).
_FREEZE_POINTS = [
    "trainer.after_update",
    "noise.after_gemv",
    "checkpoint.before_array",
    "checkpoint.after_arrays",
    "checkpoint.before_manifest",
]


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def local_s3_server() -> tuple[Any, dict[str, Any], str]:
    """A real S3 endpoint on 127.0.0.1 (moto's server mode) with one bucket, for
    takeover trials: (server, storage options, bucket). Stop it with `server.stop()`.

    Raises:
        ImportError: moto's server is not installed (the `test` extra has it).
    """
    import os
    import socket

    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        raise ImportError(
            "takeover trials need a local S3 server: pip install 'cocoon-ckpt[test]' "
            f"(moto[server]) or pass an endpoint ({exc})"
        ) from exc
    for k, v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    bucket = "cocoon-chaos"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    return server, opts, bucket


def run_takeover_chaos(
    train_args: list[str],
    *,
    trials: int,
    seed: int,
    storage_options: dict[str, Any],
    bucket: str,
    steps: int,
    checkpoint_every: int,
    report: ChaosReport | None = None,
) -> ChaosReport:
    """`trials` takeovers on S3: writer A (`cocoon-ckpt train <train_args>` in a
    subprocess, `steps` steps checkpointed every `checkpoint_every`) runs and freezes
    itself (SIGSTOP: a GC pause, a frozen VM) at a random crash point and step, writer B runs the same job with `--takeover` to
    completion, and A is woken (SIGCONT). A must be fenced with a one-line error: no
    manifest of A's lease generation may follow B's first one. B's final model must
    equal an uninterrupted run's bit for bit. `train_args` must not name
    --store/--key-file/--storage-options.
    """
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    import torch

    report = ChaosReport() if report is None else report
    rng = random.Random(seed)
    cmd = [sys.executable, "-m", "cocoon_ckpt", "train", *train_args, "--no-progress"]
    opts = ["--storage-options", json.dumps(storage_options)]
    ckpt_steps = checkpoint_steps(steps, checkpoint_every)

    with tempfile.TemporaryDirectory() as tmp:
        key, gold = _golden_model(cmd, tmp)
        for trial in range(trials):
            report.takeover_trials += 1
            url = f"s3://{bucket}/takeover-{seed}-{trial}-{uuid.uuid4().hex[:8]}.zarr"
            run = [*cmd, "--store", url, "--key-file", key, *opts]
            point = rng.choice(_FREEZE_POINTS)
            step = (
                rng.choice(ckpt_steps)
                if point.startswith("checkpoint.")
                else rng.randrange(checkpoint_every, steps)
            )
            env = {**os.environ, "COCOON_CRASH_AT": f"{point}:step={step}:stop"}
            a = subprocess.Popen(run, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            # Wait until A has frozen itself at the point (a GC pause, a frozen VM, a
            # partitioned host), let B take over and finish, then wake A.
            deadline = time.monotonic() + 300
            while a.poll() is None and not _stopped(a.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            a_done_first = a.poll() is not None
            b = subprocess.run([*run, "--takeover"], capture_output=True, text=True)
            if not a_done_first:
                a.send_signal(signal.SIGCONT)
            try:
                a.wait(timeout=120)
            except subprocess.TimeoutExpired:
                a.kill()
                a.wait()
            a_err = a.stderr.read().decode() if a.stderr else ""
            if b.returncode != 0:
                report.divergences += 1
                report.failures.append(
                    f"takeover trial {trial}: writer B exited {b.returncode}: {b.stderr.strip()}"
                )
                continue
            report.faults[
                "takeover after writer A finished"
                if a_done_first
                else f"takeover of writer A frozen at {point}, then A woken"
            ] += 1
            if a.returncode != 0:
                # refused at its next begin or commit (fenced), or, woken inside the commit
                # window, its manifest refused because B already created that version
                report.fenced_writers += 1
                if "Traceback" in a_err or len(a_err.strip().splitlines()) != 1:
                    report.divergences += 1
                    report.failures.append(
                        f"takeover trial {trial}: A's error is not one line: {a_err!r}"
                    )
            report.resumes += 1
            opened = Store.open(url, storage_options=storage_options, create=False)
            opened.backend.fs.invalidate_cache()  # fsspec shares one cached instance
            gens = [(v, int(opened.manifest(v).writer["generation"])) for v in opened.versions()]
            b_gen = max(g for _, g in gens)
            first_b = min(v for v, g in gens if g == b_gen)
            late = [v for v, g in gens if v > first_b and g != b_gen]
            if late:
                report.unfenced_commits += len(late)
                report.failures.append(
                    f"takeover trial {trial}: versions {late} committed by a superseded writer"
                )
            try:
                got = _export(url, f"{tmp}/t{trial}.pt", opts)
            except RuntimeError as exc:
                report.divergences += 1
                report.failures.append(f"takeover trial {trial}: {exc}")
                continue
            if not all(torch.equal(gold[k], got[k]) for k in gold):
                report.divergences += 1
                report.failures.append(f"takeover trial {trial}: final model differs")
    return report
