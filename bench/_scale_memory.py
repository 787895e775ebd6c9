"""Peak RSS of our DP step at scale, broken down by owner and by phase
(`python bench/scale.py --85m --memory`; #31 item 2).

One subprocess per clipping mode (ghost, vmap) runs the model of bench/scale.py in
`DPTrainer` for 9 steps and takes an asynchronous checkpoint every 4 into a store in
`--far-dir` (default /var/tmp), so steps with a write in flight are measured too. Around each phase of a step (the clipped sum, the fresh noise, the
ring's GEMV, the ring write, the noisy gradients, the optimizer, the snapshot) the
process's high-water mark is reset (/proc/self/clear_refs) and read back, so each
phase's peak is its own; with `--tracemalloc`, tracemalloc counts the numpy buffers
beside it (the ring, the GEMV's output, snapshot copies), torch's CPU tensors being
invisible to it. It is off by default: its own tables are part of the RSS it would
measure (72 MiB of its own and 105 more of the main arena at rest, 1,308 against 1,200
MiB, in a ghost trainer of 4 blocks at d 768), which no job pays and the bound's
non-private step does not run.

Owners are the live objects' bytes at the step's end: model, gradients, optimizer state,
ring, the last w_t the trainer keeps (none when w_t is the ring's slot), snapshot buffers kept for reuse, the copies of the
snapshot in flight and the ring rows lent to it (views of the ring, no memory); what
the peak holds beyond them is the phase's transients plus the allocator's slack
(glibc gives arrays this large their own mappings and unmaps them when freed, so a freed
array leaves nothing behind, and every new one is first-touched again).

The bound (#31 item 2): the non-private step's peak + the ring + one per-sample chunk
(what the clipped sum alone peaks above the non-private step, run in its own process)
+ one model, +10%.

Each mode runs once per lent-row policy (`Checkpointer(lent_rows=...)`: "copy" a ring
row the writer has not written before the step overwrites it, or "wait" for the writer,
the default, which copies only past `LENT_ROW_WAIT_S`),
and prints the step's wall time with a write in flight against without (what waiting
costs). glibc's allocator is read beside: `mallinfo2` (arenas from the system, free in
them, mmapped chunks) after every step and around every phase ("arenas grew"), and
`malloc_info` per arena at the end, with the arena of each checkpointer thread (a probe
run on that thread). Run alone (`python bench/_scale_memory.py --85m --physical 8
--lent-rows copy wait [--env - MALLOC_MMAP_THRESHOLD_=131072]`) it measures ghost
only, once per environment given to the measured process (`-`: as it is), the
variants taking turns.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Any

MIB = 1 << 20
_LIBC = ctypes.CDLL("libc.so.6")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd")
        + ("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


_LIBC.mallinfo2.restype = _Mallinfo2
_LIBC.fopen.restype = ctypes.c_void_p
_LIBC.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
_LIBC.fclose.argtypes = [ctypes.c_void_p]
_LIBC.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
_LIBC.malloc.restype = ctypes.c_void_p
_LIBC.malloc.argtypes = [ctypes.c_size_t]
_LIBC.free.argtypes = [ctypes.c_void_p]


def _mallinfo() -> dict[str, float]:
    """glibc's totals over every arena (MiB): `heap` obtained from the system by the
    arenas (brk and thread heaps), of it `free` (held, not in use), `top` the part at
    the main heap's top that a trim could return; `mmapped` the chunks of their own."""
    m = _LIBC.mallinfo2()
    return {
        "heap": m.arena / MIB,
        "free": m.fordblks / MIB,
        "top": m.keepcost / MIB,
        "mmapped": m.hblkhd / MIB,
    }


def _arenas() -> list[dict[str, float]]:
    """Per arena (malloc_info's order: 0 the main thread's, then the newest thread
    arena first): MiB obtained from the system and MiB of it free."""
    fd, path = tempfile.mkstemp()
    os.close(fd)
    try:
        f = _LIBC.fopen(path.encode(), b"w")
        _LIBC.malloc_info(0, f)
        _LIBC.fclose(f)
        root = ET.parse(path).getroot()
    finally:
        os.unlink(path)
    out = []
    for heap in root.findall("heap"):
        free = sum(int(t.get("size", 0)) for t in heap.findall("total"))
        cur = next(
            (int(t.get("size", 0)) for t in heap.findall("system") if t.get("type") == "current"), 0
        )
        out.append({"nr": int(heap.get("nr", -1)), "system": cur / MIB, "free": free / MIB})
    return out


# glibc 2.36 x86-64 `struct malloc_state`: `system_mem` after the bins and the list
# links; a non-main arena's heap starts with a `heap_info` whose first field is its
# arena. Only a bench probe: checked for sanity (attached threads) before use.
_HEAP_MAX = 64 << 20
_SYSTEM_MEM_AT, _ATTACHED_AT = 2184, 2176


def _my_arena_system_mib() -> float | None:
    """The system bytes (MiB) of the calling thread's arena, or None: the main arena
    (memory from brk) or a layout this probe does not know."""
    p = _LIBC.malloc(64)
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if line.rstrip().endswith("[heap]"):
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    if lo <= p < hi:
                        return None
        arena = ctypes.c_void_p.from_address(p & ~(_HEAP_MAX - 1)).value
        if not arena:
            return None
        attached = ctypes.c_size_t.from_address(arena + _ATTACHED_AT).value
        if not 0 < attached < 64:
            return None
        return ctypes.c_size_t.from_address(arena + _SYSTEM_MEM_AT).value / MIB
    finally:
        _LIBC.free(p)


def _arena_owners(ck: Any) -> dict[str, float | None]:
    """The system MiB of the arenas of the checkpointer's threads (None: main's)."""
    out: dict[str, float | None] = {"training (main)": None}
    for name, pool in (
        ("writer (bulk)", ck._bulk),
        ("writer", ck._pool),
        ("retention", ck._retainer),
        ("epsilon", ck._accounting),
    ):
        if pool._threads:  # only threads that ran
            out[name] = pool.submit(_my_arena_system_mib).result()
    return out


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Phases:
    """Per-phase peak RSS (VmHWM reset at every boundary) and numpy peak (tracemalloc)."""

    def __init__(self) -> None:
        self.label = "other"
        self.stack: list[str] = []
        self.peak: dict[str, float] = {}  # label -> peak RSS MiB
        self.rise: dict[str, float] = {}  # label -> peak above the RSS at its entry, MiB
        self.np_rise: dict[str, float] = {}  # label -> numpy peak above its entry, MiB
        # label -> what the arenas (brk + thread heaps) grew by over the phase, MiB
        self.heap_rise: dict[str, float] = {}
        self._entry_rss = _status_kib("VmRSS") / 1024
        self._entry_np = 0.0
        self._entry_heap = 0.0
        self._reset()

    def _reset(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self._entry_rss = _status_kib("VmRSS") / 1024
        tracemalloc.reset_peak()
        self._entry_np = tracemalloc.get_traced_memory()[0] / MIB
        self._entry_heap = _mallinfo()["heap"]

    def _close(self) -> None:
        hwm = _status_kib("VmHWM") / 1024
        np_peak = tracemalloc.get_traced_memory()[1] / MIB
        lab = self.label
        self.peak[lab] = max(self.peak.get(lab, 0.0), hwm)
        self.rise[lab] = max(self.rise.get(lab, 0.0), hwm - self._entry_rss)
        self.np_rise[lab] = max(self.np_rise.get(lab, 0.0), np_peak - self._entry_np)
        grew = _mallinfo()["heap"] - self._entry_heap
        self.heap_rise[lab] = max(self.heap_rise.get(lab, 0.0), grew)

    def enter(self, label: str) -> None:
        self._close()
        self.stack.append(self.label)
        self.label = label
        self._reset()

    def leave(self) -> None:
        self._close()
        self.label = self.stack.pop()
        self._reset()

    def wrap(self, obj: Any, name: str, label: str) -> None:
        """Time `obj.name` as phase `label` (an instance attribute shadows the method)."""
        fn: Callable[..., Any] = getattr(obj, name)

        def wrapped(*a: Any, **kw: Any) -> Any:
            self.enter(label)
            try:
                return fn(*a, **kw)
            finally:
                self.leave()

        setattr(obj, name, wrapped)


def _owners(trainer: Any, ck: Any) -> dict[str, float]:
    """Bytes (MiB) of the live owners the trainer and checkpointer hold now."""
    import torch

    from cocoon_ckpt.format.snapshot import BUFFERS

    model = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    flat = getattr(trainer._noisy, "_flat", None)
    grads = flat.numel() * flat.element_size() if flat is not None else 0
    opt = sum(
        v.numel() * v.element_size()
        for st in trainer.optimizer.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )
    last = trainer.last_noise
    # w_t computed in its ring slot is a view of the ring (owns nothing); in the
    # trainer's kept buffer it is that buffer's bytes
    if last is not None and last.data_ptr() != trainer._w.data_ptr():
        last = None
    kept = sum(a.nbytes for free in BUFFERS._free.values() for a in free)
    snap = ck._writing if ck is not None else None
    arrays = list(snap.arrays.values()) if snap is not None else []
    # a lent ring row is a read-only view of the ring (owns nothing); a copy owns its bytes
    writing = sum(a.nbytes for a in arrays if a.flags.writeable)
    lent = sum(a.nbytes for a in arrays if not a.flags.writeable)
    return {
        "model": model / MIB,
        "gradients (flat)": grads / MIB,
        "optimizer state": opt / MIB,
        "ring": trainer.noise.history_bytes() / MIB,
        "last w_t kept": (last.numel() * last.element_size() if last is not None else 0) / MIB,
        "snapshot buffers kept": kept / MIB,
        "snapshot in flight (copies)": writing / MIB,
        "ring rows lent to it (no copy)": lent / MIB,
    }


def child(spec: dict[str, Any]) -> None:
    """One instrumented DP step run in this process: prints one JSON line."""
    import scale  # bench/ is on sys.path: this file runs as a script from there
    import torch

    from cocoon_ckpt.train import checkpoint as ckpt_mod
    from cocoon_ckpt.train.job_records import REQUIRED
    from state import Store

    torch.set_num_threads(spec["threads"])
    if spec.get("tracemalloc"):
        tracemalloc.start()
    rss = {"imports": _status_kib("VmRSS") / 1024}
    model, x, y = scale.make(spec)
    rss["model built"] = _status_kib("VmRSS") / 1024
    b = spec["batch"]
    batches = [(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b]) for i in range(64)]
    step = scale._step(
        spec["kind"], model, torch.nn.functional.cross_entropy, spec, batches, torch.device("cpu")
    )
    trainer = step.trainer
    rss["trainer built (ring allocated)"] = _status_kib("VmRSS") / 1024
    root = tempfile.mkdtemp(dir=spec["memory_dir"])
    store = Store.open(os.path.join(root, "s.zarr"))
    store.acquire_lease()
    ck = ckpt_mod.Checkpointer(
        store, async_write=True, keep_last=2, lent_rows=spec.get("lent_rows", "wait")
    )
    records = {name: {"bench": True} for name in REQUIRED}
    ph = Phases()
    ph.wrap(trainer, "_clipped", "clipped sum")
    # a step in the ring slot draws z part by part and runs no `history.gemv`/`write`
    ph.wrap(trainer.noise, "step", "noise step")
    ph.wrap(trainer.noise.fresh_noise, "fresh", "fresh noise z")
    ph.wrap(trainer.noise.history, "gemv", "ring GEMV")
    ph.wrap(trainer.noise.history, "write", "ring write")
    ph.wrap(trainer._noisy, "set", "noisy gradients")
    ph.wrap(trainer.optimizer, "step", "optimizer")
    real_snapshot = ckpt_mod.take_snapshot

    def snapshot(*a: Any, **kw: Any) -> Any:
        ph.enter("snapshot")
        try:
            return real_snapshot(*a, **kw)
        finally:
            ph.leave()

    ckpt_mod.take_snapshot = snapshot  # type: ignore[assignment]
    steps: list[dict[str, Any]] = []
    peak_all = 0.0
    slack = float("nan")
    try:
        for i in range(spec["memory_steps"]):
            in_flight = ck.in_flight
            ph.peak, ph.rise, ph.np_rise, ph.heap_rise = {}, {}, {}, {}
            ph.label = "step (rest)"
            ph._reset()
            t = time.perf_counter()
            step(i)
            wall = time.perf_counter() - t
            ph._close()
            ck_peak = 0.0
            saved = (i + 1) % spec["memory_every"] == 0
            if saved:
                ph.label = "checkpoint save (training thread)"
                ph._reset()
                ck.save(trainer, dict(records))
                ph._close()
            row = {
                "step": i,
                "wall_s": wall,
                "write_in_flight": in_flight,
                "checkpoint_after": saved,
                "peak": dict(ph.peak),
                "rise": dict(ph.rise),
                "np_rise": dict(ph.np_rise),
                "heap_rise": dict(ph.heap_rise),
                "owners": _owners(trainer, ck),
                "rss_end": _status_kib("VmRSS") / 1024,
                "malloc": _mallinfo(),
                "arenas": _arenas(),
                "copied": ck._lent.copied,
                "waited_s": ck._lent.waited_s,
            }
            ck_peak = max(ph.peak.values())
            peak_all = max(peak_all, ck_peak)
            steps.append(row)
        ck.wait()
        at_end = {"malloc": _mallinfo(), "arenas": _arenas(), "threads": _arena_owners(ck)}
        # what malloc holds freed (not returned to the system): the RSS malloc_trim frees.
        # It is the steps' working set, not added to it: a malloc_trim(0) after each
        # commit on the writer's thread (28-39 ms a call) left no slack at the end and
        # the same peak (ghost at 85.9M: 3,409-3,465 MiB against 3,407-3,464 without,
        # 2 runs each), the next steps faulting those pages in again; so none is done
        before = _status_kib("VmRSS") / 1024
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        slack = before - _status_kib("VmRSS") / 1024
    finally:
        ck.close()
        store.release_lease()
        trainer.close()
        shutil.rmtree(root, ignore_errors=True)
    out = {
        "kind": spec["kind"],
        "rss": rss,
        "steps": steps,
        "peak": peak_all,
        "slack": slack,
        "at_end": at_end,
        "tracemalloc_mib": tracemalloc.get_tracemalloc_memory() / MIB,
    }
    print(json.dumps(out))


def _run(spec: dict[str, Any], kind: str) -> dict[str, Any] | None:
    env = {**os.environ, **spec.get("env", {})}
    cmd = [sys.executable, __file__, json.dumps({**spec, "kind": kind})]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        print(f"  {kind}: failed: {done.stderr.strip().splitlines()[-3:]}")
        return None
    r: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return r


def report(
    spec: dict[str, Any],
    clippings: list[str],
    every: int,
    steps: int,
    where: str,
    policies: tuple[str, ...] = ("copy", "wait"),
    envs: tuple[dict[str, str], ...] = ({},),
    trace: bool = False,
) -> None:
    """The memory table of each clipping mode against the bound (bench/scale.py --memory),
    once per lent-row policy (`Checkpointer(lent_rows=...)`)."""
    import scale

    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    spec = {
        **spec,
        "memory_every": every,
        "memory_steps": steps,
        "memory_dir": where,
        "tracemalloc": trace,
    }
    plain = scale.run({**spec, "steps": 1, "warmup": 1}, "non-private")
    if plain is None:
        return
    print(
        f"depth {spec['depth']}, d {spec['d']}, batch {spec['batch']}, physical "
        f"{spec['physical']}, bands {spec['bands']}, {plain['params'] / 1e6:.1f}M parameters; "
        f"non-private peak RSS {plain['rss_mib']:.0f} MiB"
    )
    for kind in clippings:
        alone = scale.run({**spec, "steps": 1, "warmup": 1}, f"{kind}-clip")
        for env in envs:
            for policy in policies:
                r = _run({**spec, "lent_rows": policy, "env": env}, kind)
                if r is None or alone is None:
                    continue
                print(f"\n{kind}, lent_rows={policy!r}" + (f", {env}" if env else "") + ":", end="")
                _print_run(r, plain, alone)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


def _print_run(r: dict[str, Any], plain: dict[str, Any], alone: dict[str, Any]) -> None:
    last = r["steps"][-1]["owners"]
    model, ring = last["model"], last["ring"]
    chunk = max(0.0, alone["rss_mib"] - plain["rss_mib"])
    bound = plain["rss_mib"] + ring + chunk + model
    print(
        f" peak RSS {r['peak']:.0f} MiB = {r['peak'] / plain['rss_mib']:.2f}x "
        f"non-private; bound {bound:.0f} MiB (+10%: {1.1 * bound:.0f}) = non-private "
        f"{plain['rss_mib']:.0f} + ring {ring:.0f} + chunk {chunk:.0f} (clipped sum alone "
        f"{alone['rss_mib']:.0f}) + model {model:.0f}: peak / bound "
        f"{r['peak'] / bound:.2f}"
    )
    walls: dict[bool, list[float]] = {False: [], True: []}
    peaks: dict[bool, float] = {False: 0.0, True: 0.0}
    for st in r["steps"][1:]:
        walls[st["write_in_flight"]].append(st["wall_s"])
        peaks[st["write_in_flight"]] = max(peaks[st["write_in_flight"]], max(st["peak"].values()))
    if walls[True] and walls[False]:
        print(
            f"  with a write in flight: peak / bound {peaks[True] / bound:.2f}, step wall "
            f"median {statistics.median(walls[True]):.2f} s ({len(walls[True])} steps); "
            f"without: {peaks[False] / bound:.2f}, {statistics.median(walls[False]):.2f} s "
            f"({len(walls[False])}): in flight / not "
            f"{statistics.median(walls[True]) / statistics.median(walls[False]):.2f}; "
            f"lent rows copied out: {r['steps'][-1]['copied']}, the steps waited for the "
            f"writer {r['steps'][-1]['waited_s']:.2f} s in all"
        )
    end = r["at_end"]
    m = end["malloc"]
    print(
        f"  allocator after the last write: arenas {m['heap']:.0f} MiB from the system, "
        f"{m['free']:.0f} free ({m['top']:.0f} at the main heap's top), mmapped chunks "
        f"{m['mmapped']:.0f}; malloc_trim freed {r['slack']:.0f} MiB of RSS; tracemalloc's "
        f"own {r['tracemalloc_mib']:.0f} MiB (0: off)"
    )
    print(
        "  arenas (nr: system / free MiB; 0 is the main thread's): "
        + ", ".join(f"{a['nr']}: {a['system']:.0f} / {a['free']:.0f}" for a in end["arenas"])
    )
    print(
        "  arena of each checkpointer thread (system MiB; None: the main arena): "
        + ", ".join(f"{k} {v if v is None else round(v)}" for k, v in end["threads"].items())
    )
    print("  RSS at start: " + ", ".join(f"{k} {v:.0f}" for k, v in r["rss"].items()))
    print(
        "  owners at the last step's end (MiB): "
        + ", ".join(f"{k} {v:.0f}" for k, v in last.items())
    )
    phases = sorted({p for s in r["steps"] for p in s["peak"]})
    print(
        f"  {'phase':<34} {'peak MiB':>9} {'above entry':>12} {'numpy above':>12} "
        f"{'arenas grew':>12}  (max over steps; steps with a write in flight apart)"
    )
    for flight in (False, True):
        sel = [s for s in r["steps"] if s["write_in_flight"] == flight and s["step"] > 0]
        if not sel:
            continue
        print(
            f"  -- {'a checkpoint in flight' if flight else 'no write in flight'} "
            f"({len(sel)} steps, wall {statistics.median(s['wall_s'] for s in sel):.1f} s)"
        )
        for p in phases:
            vals = [s for s in sel if p in s["peak"]]
            if not vals:
                continue
            print(
                f"  {p:<34} {max(s['peak'][p] for s in vals):9.0f} "
                f"{max(s['rise'][p] for s in vals):12.0f} "
                f"{max(s['np_rise'][p] for s in vals):12.0f} "
                f"{max(s['heap_rise'].get(p, 0.0) for s in vals):12.0f}"
            )
    print(
        "  arenas after each step (system / free MiB): "
        + ", ".join(
            f"{s['step']}: {s['malloc']['heap']:.0f} / {s['malloc']['free']:.0f}"
            for s in r["steps"]
        )
    )
    first = r["steps"][0]
    print(f"  first step: peak {max(first['peak'].values()):.0f} MiB, wall {first['wall_s']:.1f} s")


def main() -> None:
    """Only this table, ghost by default, for each `--lent-rows` policy given."""
    import argparse

    import scale

    p = argparse.ArgumentParser(description=__doc__)
    scale.add_model_args(p)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--physical", type=int, default=4)
    p.add_argument("--bands", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clipping", nargs="+", default=["ghost"], choices=["ghost", "vmap"])
    p.add_argument(
        "--lent-rows",
        nargs="+",
        default=["wait"],
        choices=["copy", "wait"],
        help="the Checkpointer's policies to measure, each in its own run (default: the "
        "Checkpointer's, wait with its LENT_ROW_WAIT_S bound)",
    )
    p.add_argument("--every", type=int, default=4, help="steps between checkpoints")
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--dir", default="/var/tmp", help="the store's folder")
    p.add_argument(
        "--tracemalloc",
        action="store_true",
        help="count numpy's buffers per phase (its own tables add to the RSS measured)",
    )
    p.add_argument(
        "--env",
        nargs="+",
        default=["-"],
        help="environments of the measured process, each NAME=VALUE[,NAME=VALUE] or - "
        "(as it is), e.g. - MALLOC_MMAP_THRESHOLD_=131072",
    )
    args = p.parse_args()
    scale.model_shape(args)
    spec = {
        k: getattr(args, k)
        for k in ("depth", "d", "heads", "seq", "vocab", "classes", "batch", "physical")
        + ("bands", "threads")
    }
    spec.update(device="cpu", clock="cpu", steps=1, warmup=1)
    envs = tuple(
        {} if e == "-" else dict(kv.split("=", 1) for kv in e.split(",")) for e in args.env
    )
    report(
        spec,
        args.clipping,
        args.every,
        args.steps,
        args.dir,
        tuple(args.lent_rows),
        envs,
        args.tracemalloc,
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("{"):
        child(json.loads(sys.argv[1]))
    else:
        main()
