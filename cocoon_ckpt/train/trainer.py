"""The DP step: per-sample gradients (torch.func), clipping, correlated noise, update."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from cocoon_ckpt._state_dict import uncompiled
from cocoon_ckpt.dp.generator import NoiseRng, as_noise_rng, generator_backend
from cocoon_ckpt.dp.sampler import CyclicPoissonSampler
from cocoon_ckpt.embedding.config import EmbeddingConfig
from cocoon_ckpt.embedding.engine import TablePlan
from cocoon_ckpt.embedding.one_thread import fixed_threads
from cocoon_ckpt.embedding.tables import EmbeddingNoise
from cocoon_ckpt.errors import NonFiniteGradientError, StoredStateError
from cocoon_ckpt.format.trainer_state import (
    TRAINER_SCHEMA,
    TrainerState,
    check_trainer_state,
    load_parts,
    load_rng_state,
    load_table_arrays,
    noise_layout,
    part_states,
    rng_state,
    table_arrays,
)
from cocoon_ckpt.tiers.config import TierConfig
from cocoon_ckpt.train.config import DPConfig
from cocoon_ckpt.train.data import Batch
from cocoon_ckpt.train.device import batch_to
from cocoon_ckpt.train.distributed import DistContext, check_distributed
from cocoon_ckpt.train.ghost import GhostGrads
from cocoon_ckpt.train.grad_threads import resolve_grad_threads
from cocoon_ckpt.train.grads import ClippedSum
from cocoon_ckpt.train.identity import job_identity
from cocoon_ckpt.train.job_data import JobData
from cocoon_ckpt.train.mechanisms import (
    Mechanism,
    build_accountant,
    build_mechanism,
    build_noise,
    check_mechanism,
    tables_mechanism,
)
from cocoon_ckpt.train.model_checks import check_scheduler, checked_model
from cocoon_ckpt.train.noisy_grads import NoisyGradients
from cocoon_ckpt.train.step_result import StepResult
from cocoon_ckpt.train.table_noise import table_noise
from cocoon_ckpt.train.warm import fault_in, warm_kernels
from cocoon_ckpt.train.workers import DEFAULT_WORKER_TIMEOUT_S
from state import hooks

__all__ = ["DPTrainer", "StepResult", "build_mechanism", "check_scheduler"]

AFTER_UPDATE = hooks.declare("trainer.after_update", "after the optimizer step of step t")

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class DPTrainer:
    """Trains `model` with correlated noise (b-banded BandMF, or a BLT).

    Each step: sample the batch of step t, move it to the model's device, take
    per-sample gradients with `torch.func.vmap(grad(...))` (in chunks of at most
    `config.physical_batch_size`; with `config.clipping="ghost"` their norms from
    activations and output gradients instead, `train.ghost`), clip each to
    `max_grad_norm`, sum, add w_t (std
    sigma * clip; drawn on the host and copied to the model's device: `train.device`),
    divide by the expected batch size, step the optimizer, then the LR scheduler. A
    per-sample gradient that is not finite refuses its step before the update
    (`NonFiniteGradientError`, naming the examples' dataset indices). After
    a step the dense parameters' `.grad` hold its noisy gradient (views of one buffer
    the next step overwrites: `train.noisy_grads`).

    Args:
        model: any nn.Module torch.func can take per-sample gradients of.
        optimizer: a torch optimizer over `model`'s trainable parameters.
        loss_fn: loss(output, target) -> scalar, mean over its batch dimension.
        data: a map-style Dataset whose items are tuples (the last element is the
            target), or tensors indexed by example along dim 0 (the last is the target);
            `len(data)` must be `config.dataset_size`.
        config: the privacy configuration.
        noise_key: 32 secret bytes for the keyed noise.
        mechanism: the mechanism, a `BandMF` or (with `config.mechanism='blt'`) a `BLT`
            (built from `config` by default; a resume passes the stored one).
        tiers: where the noise history lives (`cocoon_ckpt.tiers`; None: the host).
        embedding: noise for sparse embedding tables (`cocoon_ckpt.embedding`): their
            gradients are taken per row, and their noise follows the configured path.
            Needs `data` as tensors (a TensorDataset): the tables' ids are read ahead.
        table_plans: the embedding plans a resumed job recorded (None: choose now).
        table_tiers: where each embedding table's online history lives (None: the host).
        dist: this rank's place in a torch.distributed job (`train.distributed`): it
            clips its part of each batch and keeps its shard of the history.
        overlap_noise: compute w_t in a thread while the per-sample gradients are
            taken (bit-identical either way; pays where both release the GIL).
        scheduler: an LR scheduler of `optimizer`, stepped once per DP step after it.
        stateful: other state checkpointed with the trainer's, by name (EMA, counters).
        num_workers: passed to the DataLoader of `loader()`.
        pin_memory: passed to that DataLoader; None pins batches when the model is on a
            CUDA device.
        collate_fn: passed to that DataLoader (default_collate if None).
        grad_threads: torch intra-op threads of the per-sample gradients, clipping and
            optimizer step (`train.grad_threads`); None: the default for the model's
            dense size when built (`grad_threads.default_grad_threads`).
        worker_timeout_s: seconds a step waits for a DataLoader worker's batch before the
            worker is named (`train.workers`).

    Raises:
        ConfigError: the data's size is not `config.dataset_size`; a scheduler that steps
            on a metric (`check_scheduler`); embedding noise with
            `noise_rng` other than default, or other than lazy on more than one rank
            (`train.distributed.check_distributed`; one rank runs it as one process).
        ValueError: embedding noise is configured with no table named, or
            `grad_threads` is not an int >= 1.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        data: Dataset[Any] | Sequence[torch.Tensor],
        config: DPConfig,
        noise_key: bytes,
        mechanism: Mechanism | None = None,
        tiers: TierConfig | None = None,
        embedding: EmbeddingConfig | None = None,
        table_plans: dict[str, TablePlan] | None = None,
        table_tiers: TierConfig | None = None,
        dist: DistContext | None = None,
        overlap_noise: bool = False,
        *,
        scheduler: Any = None,
        stateful: Mapping[str, Any] | None = None,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        grad_threads: int | None = None,
        worker_timeout_s: float = DEFAULT_WORKER_TIMEOUT_S,
    ) -> None:
        # asked for (None: any) and in force; a resume sets the stored count (train.resume)
        self.requested_grad_threads = grad_threads
        model = uncompiled(model)  # plain names; JobParts says why it trains the original
        # the model's and scheduler's refusals, from their one home (`check_parts` runs
        # the same before a start writes)
        checked = checked_model(model, loss_fn, config, embedding, scheduler)
        self.param_names, self.grads, self.device = (
            checked.param_names,
            checked.grads,
            checked.device,
        )
        if pin_memory is None:
            pin_memory = self.device.type == "cuda"
        self.data = JobData(
            data,
            config.dataset_size,
            needs_tensors=embedding is not None,
            num_workers=num_workers,
            pin_memory=pin_memory,
            collate_fn=collate_fn,
            worker_timeout_s=worker_timeout_s,
        )
        self.dataset = self.data.dataset
        self.noise_rng = as_noise_rng(config.noise_rng)
        noise_dtype = "float64" if self.grads.dtype == torch.float64 else "float32"
        # numba's start, the kernels' load and vmap's imports (`train.warm`), begun
        # before the build's long C work (the ring's first touch: 12-36 s at 85.9M,
        # b = 8) that leaves the GIL free for them; the build waits for what is left at
        # its end, so they never hold the GIL beside the steps
        warming = warm_kernels(
            noise_dtype,
            ziggurat=self.noise_rng is NoiseRng.DEFAULT,
            threads=torch.get_num_threads(),
        )
        if dist is not None:
            check_distributed(embedding, dist.world, config.bands)
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scheduler = scheduler
        self.stateful = dict(stateful or {})
        self.config = config
        self.mechanism: Mechanism = mechanism or build_mechanism(config)
        check_mechanism(config, self.mechanism, embedding=embedding is not None)
        self._noisy = NoisyGradients(model, self.param_names, config.batch_size)
        self.dim = sum(self._noisy.sizes)
        self.grad_threads = resolve_grad_threads(grad_threads, self.dim)  # by m when None
        self.dist = dist
        start, stop = dist.bounds(self.dim) if dist is not None else (0, self.dim)
        self.noise = build_noise(
            self.mechanism,
            self.dim,
            noise_key,
            config.sigma * config.max_grad_norm,
            noise_dtype,
            start=start,
            stop=stop,
            tiers=tiers,
            rng=self.noise_rng,
        )
        # the gradient buffer a step keeps, made now and its pages faulted in off the
        # training thread (`NoisyGradients.reserve`): the first step's first touch
        self._noisy.reserve(self.grads.dtype, self.device)
        # and the noise step's scratch, where a step computes w_t in its ring slot
        reserve_scratch = getattr(self.noise, "reserve_scratch", None)
        scratch = reserve_scratch() if reserve_scratch is not None else None
        if scratch is not None:
            fault_in([scratch])
        self.sampler = CyclicPoissonSampler(
            dataset_size=config.dataset_size,
            batch_size=config.batch_size,
            bands=config.bands,
            seed=config.seed,
        )
        self.accountant = build_accountant(config, self.mechanism)
        # what really runs, as built (a resume compares it before loading anything)
        self.identity = job_identity(
            optimizer, scheduler, self.dataset, self.data.size, config.seed, self.device
        )
        self.step_index = 0
        #: the step that raised halfway (None: the state is a step boundary's)
        self._failed_step: int | None = None
        self.last_noise: torch.Tensor | None = None
        #: w_t's buffer, kept from step to step (`noise.step(out=)`): a fresh (width,)
        #: tensor a step faulted in new pages, 0.1 s to seconds at 85.9M on this VM
        self._w = torch.empty(self.noise.width, dtype=self.noise.dtype)
        self._noise_pool = (
            concurrent.futures.ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="noise",
                # its count fixed now: started inside the gradients' pin it would keep that
                initializer=torch.set_num_threads,
                initargs=(torch.get_num_threads(),),
            )
            if overlap_noise
            else None
        )
        self.embedding: EmbeddingNoise | None = None
        self._table_grads: list[tuple[torch.Tensor, torch.Tensor]] = []
        if embedding is not None:
            self.embedding = table_noise(
                embedding,
                model,
                optimizer,
                scheduler,
                self.data.tensors,
                self.sampler.schedule(config.steps),
                tables_mechanism(self.mechanism),
                noise_key,
                config,
                table_plans,
                table_tiers,
                dist,
            )
        # what is left of the warm-up, before the trainer is handed back: beside a step
        # its imports and kernel loads held the GIL, which the step's Python work waited
        # for at each of its many short ops (a 25.8M transformer's first clipped sum
        # 2.0-2.1 s against 0.45 s; 3.4x at 85.9M, where it began after the ring's touch)
        warming.join()

    @property
    def done(self) -> bool:
        return self.step_index >= self.config.steps

    def loader(self, stop: int | None = None) -> DataLoader[Any]:
        """A DataLoader of the batches of steps `step_index`, ..., `stop` - 1 (default:
        the last step), each a `train.data.Batch` for `train_step`: nothing before the
        trainer's step is drawn, and this process's share of each in a distributed job."""
        stop = self.config.steps if stop is None else stop
        return self.data.loader(self.sampler, self.step_index, stop, self._select)

    @property
    def _select(self) -> Callable[[Any], Any] | None:
        return self.dist.my_examples if self.dist is not None else None

    def clipped_sum(self, idx: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Sum of the per-sample gradients of examples `idx`, clipped to max_grad_norm,
        flattened to (dim,), and their mean loss."""
        r = self._clipped(self.data.gather(idx))
        return r.summed, r.loss

    def _clipped(self, tensors: Sequence[torch.Tensor], into_grads: bool = False) -> ClippedSum:
        # forward, per-sample GEMMs, norms and sums (eager or replayed) at the job's count
        with fixed_threads(self.grad_threads):
            if into_grads and isinstance(self.grads, GhostGrads):
                # the sum is taken into the kept gradient buffer, the noise added there
                r = self.grads.clipped_sum(
                    tensors,
                    self.config.max_grad_norm,
                    self.config.physical_batch_size,
                    out=self._noisy.buffer(self.grads.dtype, self.device),
                )
            else:
                r = self.grads.clipped_sum(
                    tensors, self.config.max_grad_norm, self.config.physical_batch_size
                )
        self._table_grads = list(r.table_grads)
        return r

    def _nonfinite(self, t: int, batch: Batch, r: ClippedSum) -> NonFiniteGradientError | None:
        """The refusal of step t when a per-sample gradient of its batch is not finite,
        naming the examples by their dataset index (None for a finite batch)."""
        if not r.nonfinite:
            return None
        bad = [int(batch.indices[i]) for i in r.nonfinite]
        shown = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        return NonFiniteGradientError(
            f"step {t}: the per-sample gradient of dataset example{'s' if len(bad) > 1 else ''} "
            f"{shown} is not finite (NaN or inf in its inputs or target, or a loss that "
            "overflowed), and clipping cannot bound it: the step is refused before its "
            "update and nothing of it is committed (the newest version stays); fix or drop "
            "the example in the dataset, then rerun",
            step=t,
            indices=bad,
        )

    def train_step(self, batch: Batch | None = None) -> StepResult:
        """Take step t = `step_index` and advance.

        Args:
            batch: step t's batch from `loader()`; None draws it here (the same bits).

        Raises:
            ValueError: `batch` belongs to another step.
        """
        if self.done:
            raise RuntimeError(f"all {self.config.steps} steps are taken")
        t = self.step_index
        if self.noise.t != t:
            raise RuntimeError(f"noise is at step {self.noise.t}, trainer at {t}: state is torn")
        if batch is None:
            batch = self.data.draw(self.sampler, t, self._select)
        elif batch.step != t:
            raise ValueError(
                f"train_step got the batch of step {batch.step}, the trainer is at step {t}: "
                "iterate trainer.loader() (it starts at the trainer's step), or pass no batch"
            )
        mine = len(batch)
        batch = batch_to(batch, self.device)
        # from here until the step is whole, the trainer's state is no step's: a failure
        # leaves it marked, and `state_dict` refuses to snapshot it
        self._failed_step = t
        if self.embedding is not None:
            self.embedding.before_step(t)  # pending noise of the rows this step reads
        if self._noise_pool is not None:
            # w_t is computed while the gradients are: it needs nothing from them
            pending = self._noise_pool.submit(self.noise.step, self._w)
            try:
                r = self._clipped(batch.tensors, into_grads=True)
            finally:
                w = pending.result()  # never leave the ring half-written behind
            bad = self._nonfinite(t, batch, r)
        else:
            r = self._clipped(batch.tensors, into_grads=True)
            bad = self._nonfinite(t, batch, r)
            if bad is not None and self.dist is None:
                raise bad  # before the noise: the ring stays at step t
            w = self.noise.step(self._w)
        summed, loss = r.summed, r.loss
        if self.dist is not None:
            # partial sums added in rank order; every rank's noise slice to every rank
            summed = self.dist.sum_in_rank_order(summed)
            if self.embedding is not None:
                self._table_grads = self.dist.sum_rows_in_rank_order(self._table_grads)
            w = self.dist.gather_noise(w, self.dim)
            sums = self.dist.sum_in_rank_order(
                torch.tensor(
                    [0.0 if mine == 0 else loss * mine, float(mine), float(bad is not None)],
                    dtype=torch.float64,
                    device=summed.device,
                )
            )
            if sums[2] > 0:  # a rank's example is not finite: every rank raises its refusal
                self.dist.agree(bad)
            loss = float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")
        elif bad is not None:
            raise bad
        # w_t of the step just taken (for traces; not copied: the next step overwrites it)
        self.last_noise = w
        # signal against noise, for the metrics and the plots (read-only: no bit
        # changes), before `set` adds the noise into the buffer `summed` may be
        grad_norm = float(torch.linalg.vector_norm(summed))
        self._noisy.set(summed, w)
        if self.embedding is not None:
            self.embedding.set_grads(self._table_grads)
        with fixed_threads(self.grad_threads):  # a user's optimizer may reduce (norms)
            self.optimizer.step()
        if self.embedding is not None:
            # a dense table's gradient is table-sized and fresh each step: free it now
            self.optimizer.zero_grad(set_to_none=True)
            self.embedding.sgd_updates(t, self._table_grads)
            if t + 1 == self.config.steps:
                self.embedding.finish()  # tails: the final model carries all its noise
        if self.scheduler is not None:
            self.scheduler.step()
        self.accountant.step()
        self.step_index = t + 1
        self._failed_step = None
        hooks.point(AFTER_UPDATE, step=t)
        return StepResult(
            step=t,
            loss=loss,
            batch_size=batch.logical_size,
            grad_norm=grad_norm,
            noise_norm=float(torch.linalg.vector_norm(w)),
        )

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
        writing): `cocoon_ckpt.format.codec` encodes exactly this.

        Raises:
            RuntimeError: a step raised halfway (a non-finite gradient, a failed
                collective): the state is no step's, and no version may hold it.
        """
        if self._failed_step is not None:
            raise RuntimeError(
                f"step {self._failed_step} stopped halfway, so this trainer's state is no "
                "step's and cannot be checkpointed; reopen the job from its store"
            )
        scheduler, stateful = part_states(self.scheduler, self.stateful)
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
            "generator": generator_backend(self.noise_rng),
            "rng": rng_state(),
            "embedding": self.embedding.state_dict() if self.embedding is not None else None,
            "embedding_tables": table_arrays(self.embedding)
            if self.embedding is not None
            else None,
            "identity": self.identity,
            "scheduler": scheduler,
            "stateful": stateful,
        }

    def load_state_dict(self, state: TrainerState) -> None:
        """Restore `state` (as `state_dict()` returns it, or `codec.decode` reads it).

        The layout, mechanism and generator entries describe the state; a resume
        compares the mechanism and generator before it loads (`train.resume`).

        Raises:
            StateSchemaError: not a DPTrainer state of this schema.
            ValueError: the state belongs to another job (sampler, accountant, ring
                shard, embedding tables or their noise order, scheduler or stateful
                parts differ).
        """
        check_trainer_state(state, self.scheduler, self.stateful)
        if (state["embedding"] is None) != (self.embedding is None):
            raise StoredStateError("the stored state and this trainer disagree on embedding tables")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.noise.load_state_dict(state["noise"])
        if state["sampler"] != self.sampler.state_dict():
            raise StoredStateError(f"sampler state {state['sampler']} does not match this job's")
        self.accountant.load_state_dict(state["accountant"])
        if self.embedding is not None and state["embedding"] is not None:
            load_table_arrays(self.embedding, state["embedding_tables"] or [])
            self.embedding.load_state_dict(state["embedding"])
        load_parts(state, self.scheduler, self.stateful)
        load_rng_state(state["rng"])
        self.step_index = int(state["step"])
