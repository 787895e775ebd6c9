"""A ring larger than host memory, killed and resumed: bench/scale.py's transformer as a
real resumable job (`open_job`, checkpoint every `--every` steps) whose BandMF ring is
split over a host budget (`--host-budget`) and a far tier backed by a file in
`--far-dir` on the local disk (#31 item 5).

Three runs of the same job, each its own process, all sharing one `--key-file`:

- gold: `--steps` steps uninterrupted (store `gold.zarr`);
- killed: the same job on another store (`run.zarr`), SIGKILLed (`kill -9` from this
  process) once the checkpoint of step `--every` is committed and about half a step into
  a step after it, before the next checkpoint;
- resumed: the same command again on `run.zarr`: it resumes from the committed version
  (the ring restored onto the far file) and runs to `--steps`.

Then the newest versions of the two stores are compared bit for bit: every stored ring
row by the step it holds, and every other array (parameters, optimizer, generator
states) by name, as bytes (no tolerance). Exit 1 if anything differs or the kill did
not land after a committed checkpoint and inside a step. Printed: each run's wall time
(the job's open or resume, each step, the close), the bytes each version folder holds,
the trainer's peak RSS (ru_maxrss) and the far worker's, the far file's size on disk,
and the load average as each run starts.

The runs are phases of one work folder (`--work`), so each can run on its own under
the shared big-run lock, released between them:

    W=/var/tmp/far_resume; A="--85m --bands 32 --host-budget 4GB --far-dir $W/far --work $W"
    flock /tmp/cocoon-big.lock python bench/far_resume.py $A --phase gold
    flock /tmp/cocoon-big.lock python bench/far_resume.py $A --phase killed
    flock /tmp/cocoon-big.lock python bench/far_resume.py $A --phase resumed
    flock /tmp/cocoon-big.lock python bench/far_resume.py $A --phase compare  # + deletes

`--phase all` runs the four in one process; `--depth 24 --d 1024 --heads 16 --vocab 50257`
is the GPT-2-medium shape (354M). The stores and the far folder are deleted after the
comparison (`--keep` keeps them); a folder a killed run leaves in `--far-dir` is swept
by the resumed run.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import scale  # bench/scale.py: the model builder, byte sizes, /proc readers
import torch

PHASES = ["gold", "killed", "resumed", "compare"]


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("depth", "d", "heads", "seq", "vocab", "classes", "batch", "physical", "bands")
    spec = {k: getattr(args, k) for k in keys}
    spec |= {"steps": args.steps, "every": args.every, "host_budget": args.host_budget}
    spec |= {"far_dir": str(Path(args.far_dir).resolve()), "threads": args.threads}
    return spec


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def child(spec: dict[str, Any], store: str, key_file: str) -> None:
    """One run of the job in this fresh process: open (or resume), steps to
    `spec['steps']`, close. One JSON line per event on stdout."""
    from cocoon_ckpt import DPConfig, JobConfig, JobOptions, JobParts, open_job
    from cocoon_ckpt.tiers import TierConfig

    t0 = time.perf_counter()
    torch.set_num_threads(spec["threads"])
    model, x, y = scale.make(spec)  # seeded: the same model and data in every run
    n = int(x.shape[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    parts = JobParts(
        model=model, optimizer=opt, loss_fn=torch.nn.functional.cross_entropy, dataset=(x, y)
    )
    dp = DPConfig(
        steps=max(spec["steps"], spec["bands"]),  # bands <= steps; the runs stop at --steps
        batch_size=spec["batch"],
        dataset_size=n,
        noise_multiplier=1.0,
        bands=spec["bands"],
        physical_batch_size=spec["physical"],
        clipping="ghost",
    )
    tiers = TierConfig(
        device_bytes=0, host_bytes=spec["host_budget"], far_bytes=None, far_dir=spec["far_dir"]
    )
    config = JobConfig(
        job="bench:far_resume",
        dp=dp,
        lr=0.01,
        optimizer="sgd",
        checkpoint_every=spec["every"],
        tiers=tiers,
        grad_threads=spec["threads"],
        options={k: spec[k] for k in ("depth", "d", "heads", "vocab", "seq", "classes")},
    )
    built = time.perf_counter()
    with open_job(config, store, parts, options=JobOptions(key_file=key_file)) as job:
        history = job.trainer.noise.state_rows
        placed = {p["tier"]: p["stop"] - p["start"] for p in history.placement()}
        worker = scale._far_worker_pid(SimpleNamespace(trainer=job.trainer))
        _emit(
            "open",
            build_s=built - t0,
            open_s=time.perf_counter() - built,
            resumed_from=job.resumed_from,
            params=sum(p.numel() for p in model.parameters()),
            slots=history.slots,
            columns=placed,
            pid=os.getpid(),
        )
        last = time.perf_counter()
        for res in job.steps(until=spec["steps"]):
            now = time.perf_counter()
            _emit("step", step=res.step, s=now - last)
            last = now
        far_mib = scale._status_kib("VmHWM", worker) / 1024 if worker is not None else 0.0
        far_file = sum(
            p.stat().st_blocks * 512 for p in Path(spec["far_dir"]).rglob("*") if p.is_file()
        )
        closing = time.perf_counter()
    _emit(
        "closed",
        close_s=time.perf_counter() - closing,
        wall_s=time.perf_counter() - t0,
        rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        far_worker_mib=far_mib,
        far_file_bytes=far_file,
    )


class Run:
    """A child process whose JSON lines are read by a thread into a queue."""

    def __init__(self, spec: dict[str, Any], store: Path, key: Path, err: Path) -> None:
        cmd = [sys.executable, __file__, "--child", json.dumps(spec), str(store), str(key)]
        self.start = time.perf_counter()
        self.load = os.getloadavg()[0]
        with err.open("wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=f, text=True)
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self.done = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put({**json.loads(line), "at": time.perf_counter()})
        self.events.put(None)

    def next(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next event; None at the end of output (or on timeout: check `done`)."""
        try:
            ev = self.events.get(timeout=timeout)
        except queue.Empty:
            return None
        if ev is None:
            self.done = True
        else:
            self.seen.append(ev)
        return ev

    def drain(self) -> int:
        while self.next() is not None:
            pass
        return self.proc.wait()


def _versions(store: Path) -> dict[int, int]:
    """Committed versions of `store`: version -> step (read from the manifests)."""
    out = {}
    for p in sorted((store / "manifests").glob("*.json")) if store.exists() else []:
        try:
            m = json.loads(p.read_text())
        except (OSError, ValueError):
            continue  # being written
        out[int(m["version"])] = int(m["step"])
    return out


def _folder_bytes(store: Path) -> dict[str, int]:
    """Bytes on disk under each version folder of `store`."""
    out = {}
    for folder in sorted((store / "versions").iterdir()):
        if folder.is_dir():
            out[folder.name] = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return out


def _summary(name: str, run: Run, rc: int) -> dict[str, Any]:
    ev = {e["event"]: e for e in run.seen}
    steps = [e for e in run.seen if e["event"] == "step"]
    out = {
        "run": name,
        "rc": rc,
        "load": run.load,
        "wall_s": (run.seen[-1]["at"] if run.seen else time.perf_counter()) - run.start,
        "steps": {e["step"]: round(e["s"], 2) for e in steps},
    }
    out |= {k: v for k, v in ev.get("open", {}).items() if k not in ("event", "at")}
    out |= {k: v for k, v in ev.get("closed", {}).items() if k not in ("event", "at")}
    return out


def _record(work: Path, entry: dict[str, Any]) -> None:
    with (work / "results.jsonl").open("a") as f:
        f.write(json.dumps(entry) + "\n")
    print(json.dumps(entry), flush=True)


def phase_gold(spec: dict[str, Any], work: Path) -> bool:
    run = Run(spec, work / "gold.zarr", work / "noise.key", work / "gold.err")
    rc = run.drain()
    entry = _summary("gold", run, rc) | {"versions": _versions(work / "gold.zarr")}
    entry["version_bytes"] = _folder_bytes(work / "gold.zarr") if rc == 0 else {}
    _record(work, entry)
    return rc == 0


def phase_killed(spec: dict[str, Any], work: Path) -> bool:
    """The run SIGKILLed half a step into a step after the checkpoint of step k, before
    the next one (steps k .. 2k-1)."""
    k, store = spec["every"], work / "run.zarr"
    run = Run(spec, store, work / "noise.key", work / "killed.err")
    done_at: dict[int, float] = {}  # step -> when it was reported done
    last_s = 0.0
    killed: dict[str, Any] | None = None
    while killed is None and not run.done:
        ev = run.next(timeout=0.05)
        if ev is not None and ev["event"] == "step":
            done_at[ev["step"]] = ev["at"]
            last_s = ev["s"]
        if not done_at or max(done_at) < k - 1:
            continue
        running = max(done_at) + 1  # the step in progress
        if running >= min(2 * k, spec["steps"]):
            break  # past the steps between the checkpoints: no kill landed
        committed = k in _versions(store).values()
        into = time.perf_counter() - done_at[running - 1]
        if committed and into >= last_s / 2:
            os.kill(run.proc.pid, signal.SIGKILL)
            killed = {"in_step": running, "s_into_step": round(into, 2), "step_s": last_s}
    rc = run.drain()
    entry = _summary("killed", run, rc) | {"kill": killed, "versions": _versions(store)}
    steps = entry["versions"].values()
    ok = killed is not None and rc == -signal.SIGKILL and max(steps, default=-1) == k
    entry["far_left"] = sorted(p.name for p in Path(spec["far_dir"]).iterdir())
    entry["kill_ok"] = ok
    _record(work, entry)
    return ok


def phase_resumed(spec: dict[str, Any], work: Path) -> bool:
    run = Run(spec, work / "run.zarr", work / "noise.key", work / "resumed.err")
    rc = run.drain()
    entry = _summary("resumed", run, rc) | {"versions": _versions(work / "run.zarr")}
    entry["version_bytes"] = _folder_bytes(work / "run.zarr") if rc == 0 else {}
    entry["far_left"] = sorted(p.name for p in Path(spec["far_dir"]).iterdir())
    _record(work, entry)
    return rc == 0 and entry.get("resumed_from") == spec["every"]


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def phase_compare(spec: dict[str, Any], work: Path) -> bool:
    """The newest versions of gold.zarr and run.zarr, array by array as bytes: the ring
    row by row by the step it holds, every other array by name. One array of each
    store is held at a time."""
    from state import Store
    from state.version import read_verified

    t0 = time.perf_counter()
    gold = Store.open(str(work / "gold.zarr"), create=False).latest()
    run = Store.open(str(work / "run.zarr"), create=False).latest()
    if gold is None or run is None or gold.step != run.step or gold.step != spec["steps"]:
        print(f"not comparable: gold {gold}, resumed {run}, wanted step {spec['steps']}")
        return False

    def ring(v: Any) -> dict[int, tuple[int, str, int]]:
        out = {}
        for shard in v.records["noise"]["shards"]:
            for _slot, step, array, row, _crc in shard["slots"]:
                out[step] = (shard["start"], array, row)
        return out

    def read(v: Any, name: str) -> np.ndarray:
        return read_verified(v.store, v.version, name, v.manifest.arrays[name])

    rg, rr = ring(gold), ring(run)
    ring_arrays = {a for _s, a, _r in rg.values()} | {a for _s, a, _r in rr.values()}
    diffs: list[str] = []
    if sorted(rg) != sorted(rr):
        diffs.append(f"ring steps {sorted(rg)} != {sorted(rr)}")
    rows = 0
    for step in sorted(set(rg) & set(rr)):
        (sa, aa, ra), (sb, ab, rb) = rg[step], rr[step]
        a = read(gold, aa)[ra]
        b = read(run, ab)[rb]
        rows += 1
        if sa != sb or not _same_bytes(a, b):
            diffs.append(f"ring row of step {step}")
        del a, b
    names_g = set(gold.array_names()) - ring_arrays
    names_r = set(run.array_names()) - ring_arrays
    if names_g != names_r:
        diffs.append(f"arrays only in one: {sorted(names_g ^ names_r)}")
    params = 0
    for name in sorted(names_g & names_r):
        if not _same_bytes(read(gold, name), read(run, name)):
            diffs.append(f"array {name}")
        params += 1
    entry = {
        "run": "compare",
        "step": gold.step,
        "ring_rows_compared": rows,
        "other_arrays_compared": params,
        "differ": diffs,
        "s": time.perf_counter() - t0,
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    _record(work, entry)
    if diffs:
        print(f"DIFFER: {len(diffs)}: {diffs[:10]}")
    else:
        print(
            f"bit-identical: step {gold.step}, {rows} ring rows and {params} other arrays "
            "(parameters, optimizer, generator states) equal byte for byte"
        )
    return not diffs


def report(work: Path) -> None:
    """The runs' figures from results.jsonl, one table."""
    entries = {}
    for line in (work / "results.jsonl").read_text().splitlines():
        e = json.loads(line)
        entries[e["run"]] = e
    print(
        f"\n{'run':<8} {'load':>5} {'wall s':>7} {'open s':>7} {'steps s':>24} "
        f"{'close s':>7} {'peak RSS MiB':>12} {'worker MiB':>10} {'far file GB':>11}"
    )
    for name in ("gold", "killed", "resumed"):
        e = entries.get(name)
        if e is None:
            continue
        steps = " ".join(f"{s}:{t:.1f}" for s, t in e["steps"].items())
        print(
            f"{name:<8} {e['load']:5.1f} {e['wall_s']:7.1f} {e.get('open_s', 0):7.1f} "
            f"{steps:>24} {e.get('close_s', float('nan')):7.1f} "
            f"{e.get('rss_mib', float('nan')):12.0f} {e.get('far_worker_mib', 0):10.0f} "
            f"{e.get('far_file_bytes', 0) / 1e9:11.2f}"
        )
    for name in ("gold", "resumed"):
        e = entries.get(name)
        if e and e.get("version_bytes"):
            sizes = ", ".join(f"{k}: {v / 1e9:.3f} GB" for k, v in e["version_bytes"].items())
            print(f"{name} store, bytes per version folder: {sizes}")
    if "killed" in entries:
        print(f"kill: {entries['killed']['kill']}; versions then {entries['killed']['versions']}")
    if "compare" in entries:
        c = entries["compare"]
        print(f"compare: {'bit-identical' if not c['differ'] else c['differ']} ({c['s']:.0f} s)")


def main() -> None:
    if sys.argv[1:2] == ["--child"]:  # one run: spec, store, key file
        child(json.loads(sys.argv[2]), sys.argv[3], sys.argv[4])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    scale.add_model_args(p)
    p.add_argument("--batch", type=int, default=8, help="expected batch (Poisson)")
    p.add_argument("--physical", type=int, default=4, help="examples per chunk")
    p.add_argument("--bands", type=int, default=32)
    p.add_argument("--steps", type=int, default=4, help="N: steps of every run")
    p.add_argument("--every", type=int, default=2, help="k: steps between checkpoints")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--host-budget", type=scale._bytes, default=scale._bytes("4GB"))
    p.add_argument("--far-dir", required=True, help="folder of the far file (a local disk)")
    p.add_argument("--work", required=True, help="folder of the stores, key and results")
    p.add_argument("--phase", choices=[*PHASES, "all"], default="all")
    p.add_argument("--keep", action="store_true", help="keep the stores after compare")
    args = p.parse_args()
    scale.model_shape(args)
    if not 0 < args.every < args.steps:
        p.error(f"--every {args.every}: give 0 < k < --steps {args.steps}, a step to kill in")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    Path(args.far_dir).mkdir(parents=True, exist_ok=True)
    spec = _spec(args)
    ok = True
    for phase in PHASES if args.phase == "all" else [args.phase]:
        ok = globals()[f"phase_{phase}"](spec, work) and ok
        if not ok:
            print(f"{phase}: failed (stderr in {work})")
            break
    if args.phase in ("compare", "all"):
        report(work)
        if not args.keep:
            for name in ("gold.zarr", "run.zarr"):
                shutil.rmtree(work / name, ignore_errors=True)
            shutil.rmtree(args.far_dir, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
