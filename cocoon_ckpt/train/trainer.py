"""The DP step: per-sample gradients (torch.func), clipping, correlated noise, update."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from cocoon_ckpt._state_dict import check_state
from cocoon_ckpt.dp.accountant import Accountant
from cocoon_ckpt.dp.mechanism import BandMF, MechanismKind
from cocoon_ckpt.dp.noise import CorrelatedNoise, generator_backend
from cocoon_ckpt.dp.sampler import CyclicPoissonSampler
from cocoon_ckpt.embedding.config import EmbeddingConfig
from cocoon_ckpt.embedding.engine import TablePlan
from cocoon_ckpt.embedding.sparse import gather_rows, sparse_per_sample, sum_rows
from cocoon_ckpt.embedding.tables import EmbeddingNoise
from cocoon_ckpt.errors import UnsupportedModelError
from cocoon_ckpt.tiers.build import build_history
from cocoon_ckpt.tiers.config import TierConfig
from cocoon_ckpt.train.config import DPConfig
from cocoon_ckpt.train.distributed import DistContext
from cocoon_ckpt.train.trainer_state import (
    TRAINER_SCHEMA,
    TrainerState,
    load_rng_state,
    load_table_arrays,
    noise_layout,
    rng_state,
    table_arrays,
)
from state import hooks

__all__ = ["DPTrainer", "StepResult", "build_mechanism"]

AFTER_UPDATE = hooks.declare("trainer.after_update", "after the optimizer step of step t")

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_mechanism(config: DPConfig) -> BandMF:
    """The BandMF mechanism a config asks for."""
    if config.mechanism is MechanismKind.OPTIMIZED:
        return BandMF.optimized(config.bands, config.steps)
    return BandMF.banded_sqrt(config.bands, config.steps)


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one DP step did."""

    step: int
    """The step index t just taken (0-based)."""
    loss: float
    """Mean loss over the sampled batch (nan for an empty batch)."""
    batch_size: int
    """How many examples were sampled."""


def _check_per_sample(model: nn.Module) -> None:
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.training:
            raise UnsupportedModelError(
                f"module {name or type(mod).__name__} is {type(mod).__name__} in training mode: "
                "it mixes examples within a batch, so per-sample gradients (and DP) do not "
                "exist; use GroupNorm or LayerNorm, or call .eval() on it"
            )


class DPTrainer:
    """Trains `model` with b-banded correlated noise.

    Each step: sample the batch of step t, take per-sample gradients with
    `torch.func.vmap(grad(...))`, clip each to `max_grad_norm`, sum, add w_t (std
    sigma * clip), divide by the expected batch size, and step the optimizer.

    Args:
        model: any nn.Module torch.func can take per-sample gradients of.
        optimizer: a torch optimizer over `model`'s trainable parameters.
        loss_fn: loss(output, target) -> scalar, mean over its batch dimension.
        data: tensors indexed by example along dim 0; the last one is the target.
        config: the privacy configuration.
        noise_key: 32 secret bytes for the keyed noise.
        mechanism: the mechanism (built from `config` by default).
        tiers: where the noise history may live (`cocoon_ckpt.tiers`); one host tier by
            default. The noise is the same bit for bit on any tiers.
        embedding: noise for sparse embedding tables (`cocoon_ckpt.embedding`): their
            gradients are taken per row, and their noise follows the configured path.
        table_plans: the embedding plans a resumed job recorded (None: choose now).
        table_tiers: where each embedding table's online history lives (None: the host).
        dist: this rank's place in a torch.distributed job (`cocoon_ckpt.train.distributed`):
            the rank clips its part of each batch and keeps only its shard of the
            noise history. None: one process.
        overlap_noise: compute w_t in a worker thread while the per-sample gradients
            are taken (the noise does not depend on them); the result is bit-identical
            either way. Pays where both are large enough to release the GIL.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        data: Sequence[torch.Tensor],
        config: DPConfig,
        noise_key: bytes,
        mechanism: BandMF | None = None,
        tiers: TierConfig | None = None,
        embedding: EmbeddingConfig | None = None,
        table_plans: dict[str, TablePlan] | None = None,
        table_tiers: TierConfig | None = None,
        dist: DistContext | None = None,
        overlap_noise: bool = False,
    ) -> None:
        _check_per_sample(model)
        if len(data) < 2:
            raise ValueError("data must hold at least one input tensor and the target tensor")
        n = int(data[0].shape[0])
        if any(int(d.shape[0]) != n for d in data):
            raise ValueError(
                f"data tensors disagree on the number of examples: {[d.shape[0] for d in data]}"
            )
        if n != config.dataset_size:
            raise ValueError(
                f"config.dataset_size={config.dataset_size} but data holds {n} examples"
            )
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.data = list(data)
        self.config = config
        self.mechanism = mechanism or build_mechanism(config)
        tables = {s.param for s in embedding.tables} if embedding is not None else set()
        if embedding is not None and not tables:
            raise ValueError(
                "embedding noise is configured but no table is named: list them in "
                "EmbeddingConfig.tables, or declare them in the job (JobParts.tables)"
            )
        self.param_names = [
            k for k, p in model.named_parameters() if p.requires_grad and k not in tables
        ]
        params = dict(model.named_parameters())
        self._shapes = [tuple(params[k].shape) for k in self.param_names]
        self._sizes = [params[k].numel() for k in self.param_names]
        self.dim = sum(self._sizes)
        dtype = {p.dtype for k, p in params.items() if k in self.param_names}
        if dtype - {torch.float32, torch.float64}:
            raise UnsupportedModelError(
                f"trainable parameters must be float32/float64, got {dtype}"
            )
        noise_dtype = "float64" if torch.float64 in dtype else "float32"
        if dist is not None and embedding is not None:
            raise ValueError(
                "embedding noise with torch.distributed is not supported yet: run the "
                "embedding job in one process, or drop EmbeddingConfig"
            )
        self.dist = dist
        start, stop = dist.bounds(self.dim) if dist is not None else (0, self.dim)
        history = build_history(self.mechanism.bands - 1, stop - start, noise_dtype, tiers)
        self.noise = CorrelatedNoise(
            self.mechanism,
            self.dim,
            noise_key,
            config.noise_multiplier * config.max_grad_norm,
            noise_dtype,
            start=start,
            stop=stop,
            history=history,
        )
        self.sampler = CyclicPoissonSampler(
            dataset_size=config.dataset_size,
            batch_size=config.batch_size,
            bands=config.bands,
            seed=config.seed,
        )
        self.accountant = Accountant(
            noise_multiplier=config.noise_multiplier,
            dataset_size=config.dataset_size,
            batch_size=config.batch_size,
            bands=config.bands,
            delta=config.delta,
        )
        self.step_index = 0
        self.last_noise: torch.Tensor | None = None
        self._noise_pool = (
            concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="noise")
            if overlap_noise
            else None
        )
        self.embedding: EmbeddingNoise | None = None
        self._table_grads: list[tuple[torch.Tensor, torch.Tensor]] = []
        if embedding is not None:
            self.embedding = EmbeddingNoise(
                embedding,
                model,
                optimizer,
                self.data,
                self.sampler.schedule(config.steps),
                self.mechanism,
                noise_key,
                config.noise_multiplier * config.max_grad_norm,
                config.batch_size,
                table_plans,
                table_tiers,
            )
            self._sparse = sparse_per_sample(model, loss_fn, embedding.tables, len(self.data))

        def loss_one(
            p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *xy: torch.Tensor
        ) -> torch.Tensor:
            inputs = [x.unsqueeze(0) for x in xy[:-1]]
            out = functional_call(self.model, (p, b), tuple(inputs))
            return self.loss_fn(out, xy[-1].unsqueeze(0))

        self._per_sample = vmap(
            grad_and_value(loss_one),
            in_dims=(None, None, *([0] * len(self.data))),
            randomness="different",
        )

    @property
    def done(self) -> bool:
        return self.step_index >= self.config.steps

    def clipped_sum(self, idx: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Sum of per-sample gradients clipped to max_grad_norm, flattened to (dim,)."""
        params = {k: p.detach() for k, p in self.model.named_parameters() if k in self.param_names}
        tables = {s.param for s in self.embedding.config.tables} if self.embedding else set()
        frozen = {
            k: p.detach()
            for k, p in self.model.named_parameters()
            if k not in self.param_names and k not in tables
        }
        buffers = {**dict(self.model.named_buffers()), **frozen}
        batch = [d[idx] for d in self.data]
        if self.embedding is not None:
            specs = self.embedding.config.tables
            ids, rows = gather_rows(self.model, specs, batch)
            self._table_grads = [
                (torch.zeros(0, dtype=torch.int64), torch.zeros(0, p.shape[1], dtype=p.dtype))
                for p in self.embedding.params
            ]
        if len(idx) == 0:
            return torch.zeros(self.dim, dtype=self.noise.dtype), float("nan")
        try:
            if self.embedding is not None:
                (grads, row_grads), losses = self._sparse(params, buffers, rows, *batch)
            else:
                grads, losses = self._per_sample(params, buffers, *batch)
        except RuntimeError as exc:
            raise UnsupportedModelError(
                f"torch.func could not take per-sample gradients of {type(self.model).__name__}: "
                f"{exc}. Models with in-place buffer updates or batch-coupled layers have no "
                "per-sample path"
            ) from exc
        # Per parameter, never one (batch, dim) copy: norms from per-parameter sums of
        # squares, then one GEMV (scale @ grads) per parameter.
        per_param = [grads[k].reshape(len(idx), -1) for k in self.param_names]
        sq = [g.square().sum(dim=1) for g in per_param]
        if self.embedding is not None:
            sq += [g.reshape(len(idx), -1).square().sum(dim=1) for g in row_grads]
        norms = torch.stack(sq).sum(dim=0).sqrt()
        scale = (self.config.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        summed = torch.cat([scale.to(g.dtype) @ g for g in per_param])
        if self.embedding is not None:
            self._table_grads = [sum_rows(i, g, scale) for i, g in zip(ids, row_grads, strict=True)]
        # per-sample losses come with the gradients: no second forward pass for the report
        return summed, float(losses.mean())

    def train_step(self) -> StepResult:
        """Take step t = `step_index` and advance."""
        if self.done:
            raise RuntimeError(f"all {self.config.steps} steps are taken")
        t = self.step_index
        if self.noise.t != t:
            raise RuntimeError(f"noise is at step {self.noise.t}, trainer at {t}: state is torn")
        batch = self.sampler.batch(t)
        idx = torch.from_numpy(batch if self.dist is None else self.dist.my_examples(batch))
        if self.embedding is not None:
            self.embedding.before_step(t)  # pending noise of the rows this step reads
        if self._noise_pool is not None:
            # w_t is computed while the gradients are: it needs nothing from them
            pending = self._noise_pool.submit(self.noise.step)
            try:
                summed, loss = self.clipped_sum(idx)
            finally:
                w = pending.result()  # never leave the ring half-written behind
        else:
            summed, loss = self.clipped_sum(idx)
            w = self.noise.step()
        if self.dist is not None:
            # partial sums added in rank order; every rank's noise slice to every rank
            summed = self.dist.sum_in_rank_order(summed)
            w = self.dist.gather_noise(w, self.dim)
            sums = self.dist.sum_in_rank_order(
                torch.tensor(
                    [0.0 if len(idx) == 0 else loss * len(idx), float(len(idx))],
                    dtype=torch.float64,
                )
            )
            loss = float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")
        self.last_noise = w  # w_t of the step just taken (for traces; not copied)
        noisy = (summed + w.to(summed.dtype)) / self.config.batch_size
        # Gradients are views into `noisy`, a fresh buffer per step (as DDP's buckets are).
        for p, g in zip(self._params(), torch.split(noisy, self._sizes), strict=True):
            p.grad = g.view(p.shape).to(p.dtype)
        if self.embedding is not None:
            self.embedding.set_grads(self._table_grads)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.embedding is not None:
            self.embedding.sgd_updates(t, self._table_grads)
            if t + 1 == self.config.steps:
                self.embedding.finish()  # tails: the final model carries all its noise
        self.accountant.step()
        self.step_index = t + 1
        hooks.point(AFTER_UPDATE, step=t)
        return StepResult(step=t, loss=loss, batch_size=len(batch))

    def _params(self) -> list[nn.Parameter]:
        params = dict(self.model.named_parameters())
        return [params[k] for k in self.param_names]

    def epsilon(self) -> float:
        return self.accountant.epsilon()

    def close(self) -> None:
        """Free the noise history's tiers (stops a far-memory worker). Idempotent."""
        if self._noise_pool is not None:
            self._noise_pool.shutdown(wait=True)
        self.noise.close()
        if self.embedding is not None:
            self.embedding.close()

    # state -----------------------------------------------------------------------
    def state_dict(self) -> TrainerState:
        """Everything a version holds, by reference to live tensors (copy before
        writing): `cocoon_ckpt.train.codec` encodes exactly this."""
        return {
            "kind": "DPTrainer",
            "schema_version": TRAINER_SCHEMA,
            "step": self.step_index,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "noise": self.noise.state_dict(),
            "noise_layout": noise_layout(
                self.noise,
                self.dim,
                self.param_names,
                self.dist.rank if self.dist is not None else None,
            ),
            "sampler": self.sampler.state_dict(),
            # epsilon costs a PLD composition: the checkpoint writer computes it off
            # the training thread
            "accountant": self.accountant.state_dict(with_epsilon=False),
            "mechanism": self.mechanism.state_dict(),
            "generator": generator_backend(),
            "rng": rng_state(),
            "embedding": self.embedding.state_dict() if self.embedding is not None else None,
            "embedding_tables": table_arrays(self.embedding)
            if self.embedding is not None
            else None,
        }

    def load_state_dict(self, state: TrainerState) -> None:
        """Restore `state` (as `state_dict()` returns it, or `codec.decode` reads it).

        The layout, mechanism and generator entries describe the state; a resume
        compares the mechanism and generator before it loads (`train.resume`).

        Raises:
            StateSchemaError: not a DPTrainer state of this schema.
            ValueError: the state belongs to another job (sampler, accountant, ring
                shard, embedding tables or their noise order differ).
        """
        check_state(state, "DPTrainer", TRAINER_SCHEMA)
        if (state["embedding"] is None) != (self.embedding is None):
            raise ValueError("the stored state and this trainer disagree on embedding tables")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.noise.load_state_dict(state["noise"])
        if state["sampler"] != self.sampler.state_dict():
            raise ValueError(f"sampler state {state['sampler']} does not match this job's")
        self.accountant.load_state_dict(state["accountant"])
        if self.embedding is not None and state["embedding"] is not None:
            load_table_arrays(self.embedding, state["embedding_tables"] or [])
            self.embedding.load_state_dict(state["embedding"])
        load_rng_state(state["rng"])
        self.step_index = int(state["step"])
