"""PNG plots of a store (matplotlib, headless): what `audit --plot DIR` writes.

They tell a job's story: what it spent (epsilon after each step) against what it
learned (the loss and the loop's metrics, `format.metrics`), how loud the noise is
against the largest clipped-gradient signal, where the noise history lay, and what each
checkpoint wrote. Every axis of a quantity starts at zero.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cocoon_ckpt.dp.blt.strategy import BLT
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.errors import MissingExtraError
from cocoon_ckpt.format.metrics import METRICS_RECORD, MetricsError, Series, read_metrics
from cocoon_ckpt.format.ring_rows import slot_refs, slot_values
from cocoon_ckpt.layout import array_kind
from cocoon_ckpt.tools.audit.records import config_epsilon
from cocoon_ckpt.tools.catalog import placement
from state import CorruptVersionError, Manifest, Store, Version
from state.paths import version_prefix

__all__ = ["EpsilonCurve", "epsilon_curve", "require_matplotlib", "write_plots"]

#: At most this many logged metrics besides the loss get a panel of their own.
_MAX_PANELS = 4

#: The install command named when matplotlib is missing (it is an optional extra).
PLOTS_EXTRA = "pip install 'cocoon-ckpt[plots]'"


def require_matplotlib() -> None:
    """Import matplotlib and select its headless backend (Agg).

    Raises:
        MissingExtraError: matplotlib cannot be imported; the message names the extra.
    """
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingExtraError(
            f"PNG plots (audit --plot) need matplotlib, which cannot be imported ({exc}); "
            f"install the plots extra: {PLOTS_EXTRA}"
        ) from exc
    matplotlib.use("Agg")


def _inverse_row_norms(coefficients: np.ndarray, horizon: int) -> np.ndarray:
    """||row t of C^-1|| for t < horizon, in O(horizon b) time and O(horizon) memory.

    C is lower-triangular banded Toeplitz, so C^-1 is lower-triangular Toeplitz with
    first column u (forward substitution of C u = e_0); row t is u_t, ..., u_0.
    """
    c = np.asarray(coefficients, dtype=np.float64)
    u = np.zeros(horizon)
    for t in range(horizon):
        acc = 1.0 if t == 0 else 0.0
        for j in range(1, min(len(c), t + 1)):
            acc -= c[j] * u[t - j]
        u[t] = acc / c[0]
    return np.sqrt(np.cumsum(u**2))


@dataclass(frozen=True, slots=True)
class EpsilonCurve:
    """Epsilon after k steps as a step function: `epsilons[i]` holds for every k in
    [`steps[i]`, `steps[i+1]`) (and at `steps[-1]`, the job's last step)."""

    steps: list[int]
    epsilons: list[float]

    def at(self, k: int) -> float:
        """Epsilon after `k` steps (0 <= k <= the last step)."""
        if not 0 <= k <= self.steps[-1]:
            raise ValueError(f"step {k} is outside the curve's [0, {self.steps[-1]}]")
        return self.epsilons[bisect.bisect_right(self.steps, k) - 1]


def epsilon_curve(
    dp: dict[str, Any], method: str = "pld", mechanism: dict[str, Any] | None = None
) -> EpsilonCurve:
    """Epsilon after every step 0..n of a config, composed once per participation round.

    With b-min-separated participation a round is b steps: the accounting composes
    ceil(k / b) rounds after k steps, so epsilon rises at the first step of each round
    (steps 1, b+1, 2b+1, ...) and holds through its b-th.

    Args:
        dp: the `dp` mapping of a config record.
        method: the accountant's method (`pld`, ...).
        mechanism: the version's mechanism record (a BLT run is one Gaussian over the
            whole run: its epsilon is the same bound at every step).
    """
    n, b = int(dp["steps"]), int(dp["bands"])
    steps = [0, *range(1, n + 1, b)]
    if steps[-1] != n:
        steps.append(n)  # the last point, where the curve ends
    eps = [0.0, *(config_epsilon(dp, k, method, mechanism) for k in steps[1:])]
    return EpsilonCurve(steps=steps, epsilons=eps)


def _from_zero(ax: Any, values: Iterable[float] = ()) -> None:
    """Start the x axis (steps) at 0 and the y axis at 0, or lower for negative values."""
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=min([0.0, *values]))


def _curve(ax: Any, name: str, s: Series) -> None:
    """A metric's points and, when there are many, their running mean."""
    ax.plot(s.steps, s.values, "-", lw=0.8, alpha=0.45 if len(s) > 50 else 1.0, label=name)
    window = len(s) // 25
    if window > 1:
        mean = np.convolve(s.values, np.ones(window) / window, mode="valid")
        ax.plot(s.steps[window - 1 :], mean, "-", lw=1.6, label=f"mean of {window} points")
    ax.set(ylabel=name)
    _from_zero(ax, s.values)
    ax.legend(fontsize="small")


def _slot_norms(
    store: Store, vs: list[Manifest], skip_paths: set[str] | frozenset[str]
) -> dict[int, float]:
    """||w_t|| of every stored ring slot, by step (the squares of a version's rank
    shards summed); slots in arrays out of bounds or failing verification are left out."""
    seen: dict[int, float] = {}
    for m in vs:
        ver = Version(store, m)
        squares: dict[int, float] = {}
        for shard in m.records["noise"]["shards"]:
            for ref in slot_refs(shard["slots"]):
                if m.arrays[ref.array].path in skip_paths:
                    continue
                try:
                    w = slot_values(ver, ref).astype(np.float64)
                except (CorruptVersionError, KeyError):
                    continue
                squares[ref.step] = squares.get(ref.step, 0.0) + float(w @ w)
        seen.update({t: float(np.sqrt(sq)) for t, sq in squares.items()})
    return seen


def _newest_curves(newest: Manifest) -> dict[str, Series]:
    """The newest version's metrics (none when it has no record or a malformed one:
    the audit reports that)."""
    try:
        rec = newest.records.get(METRICS_RECORD)
        return read_metrics(rec, newest.step, f"version {newest.version}")
    except MetricsError:
        return {}


def write_plots(
    store: Store,
    manifests: dict[int, Manifest],
    out_dir: str,
    *,
    skip_paths: set[str] | frozenset[str] = frozenset(),
) -> list[str]:
    """Write epsilon.png, noise_norm.png, history_tiers.png and checkpoint_sizes.png.

    epsilon.png: epsilon after each step (recomputed from the config, and as stored in
    the versions), with the loss and up to four logged metrics below it on the same
    steps. noise_norm.png: the correlated noise's norm per step (expected and stored)
    against the largest clipped-gradient sum (batch size x clip norm), and the
    `grad_norm` / `noise_norm` metrics where steps logged them. history_tiers.png:
    noise history bytes per tier and version (a line over the steps when one tier held
    it all). checkpoint_sizes.png: bytes each version wrote, by kind.

    Args:
        store: the open store.
        manifests: its readable manifests by version, whose records are within the
            config's bounds (`cocoon_ckpt.tools.bounds`).
        out_dir: created if missing.
        skip_paths: array paths never to read (out of bounds).

    Returns:
        The paths written.

    Raises:
        MissingExtraError: matplotlib is not installed (nothing is written).
    """
    require_matplotlib()
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    newest = manifests[max(manifests)]
    rec = newest.records
    dp = rec["config"]["dp"]
    vs = sorted(manifests.values(), key=lambda m: m.version)
    curves = _newest_curves(newest)
    paths: list[str] = []

    def save(fig: Any, name: str) -> None:
        p = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)

    # 1. what was spent against what was learned, on one step axis
    others = [k for k in sorted(curves) if k not in ("loss", "grad_norm", "noise_norm")]
    panels = (["loss"] if "loss" in curves else []) + others[:_MAX_PANELS]
    fig, axes = plt.subplots(1 + len(panels), 1, figsize=(6, 3 + 2 * len(panels)), sharex=True)
    axes = np.atleast_1d(axes)
    curve = epsilon_curve(
        dp, str(rec.get("accountant", {}).get("method", "pld")), rec.get("mechanism")
    )
    ax = axes[0]
    ax.step(curve.steps, curve.epsilons, where="post", label="recomputed from the config")
    # only versions that store their epsilon (a job's last; mid-run ones store the event)
    stored = [m for m in vs if m.step > 0 and m.records["accountant"].get("epsilon") is not None]
    ax.plot(
        [m.step for m in stored],
        [m.records["accountant"]["epsilon"] for m in stored],
        "o",
        label="stored in versions",
    )
    ax.set(ylabel=f"epsilon at delta={dp['delta']:g}", title="privacy spent and training curves")
    _from_zero(ax)
    ax.legend(fontsize="small")
    for ax, name in zip(axes[1:], panels, strict=True):
        _curve(ax, name, curves[name])
    axes[-1].set(xlabel="step")
    save(fig, "epsilon.png")

    # 2. signal and noise per step: stored ring slots, the expected ||w_t||, the largest
    # clipped-gradient sum, and the norms the steps logged
    seen = _slot_norms(store, vs, skip_paths)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    dim = int(rec["noise"]["dim"])
    clip = float(dp["max_grad_norm"])
    std = float(dp["noise_multiplier"]) * clip
    horizon = max([*seen, newest.step - 1, 0]) + 1
    if rec["mechanism"].get("kind") == "BLT":
        # a BLT's stored rows are its buffers, not past w_t: only the expected curve
        blt = BLT.from_state_dict(rec["mechanism"])
        seen = {}
        row_norms = np.sqrt(np.cumsum(blt.inverse_coefficients(horizon) ** 2))
    else:
        mech = BandMF.from_state_dict(rec["mechanism"])
        row_norms = _inverse_row_norms(mech.coefficients, horizon)
    expected = std * np.sqrt(dim) * row_norms
    ax.plot(range(horizon), expected, "-", label="expected ||w_t|| (std sqrt(m) ||C^-1 row||)")
    if seen:
        ks = sorted(seen)
        ax.plot(ks, [seen[k] for k in ks], "o", label="stored ring slots")
    signal = float(dp["batch_size"]) * clip
    ax.axhline(signal, color="k", ls="--", lw=1, label="largest clipped-gradient sum (B x C)")
    for name in ("noise_norm", "grad_norm"):
        if name in curves:
            ax.plot(curves[name].steps, curves[name].values, ".", ms=3, label=f"logged {name}")
    ratio = float(expected[-1]) / signal
    ax.set(xlabel="step", ylabel="L2 norm", title=f"noise against signal: {ratio:.2g}x at the end")
    _from_zero(ax)
    ax.legend(fontsize="small")
    save(fig, "noise_norm.png")

    # 3. history bytes per tier, per version
    b = int(dp["bands"])
    tiers: dict[str, list[int]] = {}
    for i, m in enumerate(vs):
        nrec = m.records["noise"]
        item = np.dtype(nrec["dtype"]).itemsize
        for shard in placement(nrec):
            row = tiers.setdefault(shard["tier"], [0] * len(vs))
            row[i] += (int(shard["stop"]) - int(shard["start"])) * (b - 1) * item
    labels = [str(m.version) for m in vs]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if len(tiers) == 1:
        # one tier: a bar per version would show one colour, so show the bytes over steps
        ((tier, row),) = tiers.items()
        ax.plot([m.step for m in vs], row, "o-", label=tier)
        ax.set(xlabel="step of the version", title=f"noise history bytes, all on {tier}")
        _from_zero(ax)
    else:
        bottom = np.zeros(len(vs))
        for tier, row in sorted(tiers.items()):
            ax.bar(labels, row, bottom=bottom, label=tier)
            bottom += np.asarray(row, dtype=float)
        ax.set(xlabel="version", title="noise history bytes per tier")
    ax.set(ylabel="bytes")
    ax.legend(fontsize="small")
    save(fig, "history_tiers.png")

    # 4. checkpoint sizes per version: bytes each version wrote, by kind
    kinds: dict[str, list[int]] = {}
    for i, m in enumerate(vs):
        own = version_prefix(m.version)
        for name, meta in m.arrays.items():
            if meta.path.startswith(own):
                kinds.setdefault(array_kind(name), [0] * len(vs))[i] += meta.nbytes
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bottom = np.zeros(len(vs))
    for kind, row in sorted(kinds.items()):
        ax.bar(labels, row, bottom=bottom, label=kind)
        bottom += np.asarray(row, dtype=float)
    total = [sum(meta.nbytes for meta in m.arrays.values()) for m in vs]
    ax.plot(labels, total, "k.--", label="referenced in all")
    ax.set(xlabel="version", ylabel="bytes", title="checkpoint bytes written per version")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    save(fig, "checkpoint_sizes.png")
    return paths
