"""`NoiseMechanismTests`: the behaviour every `NoiseMechanism` must show, as pytest
tests.

Subclass it once per implementation and override `build`::

    class TestBandMF(NoiseMechanismTests):
        def build(self, *, key, dtype, start=0, stop=None):
            return BandMFNoise(BandMF.optimized(4, 12), self.dim, key, self.std, dtype,
                               start=start, stop=stop)

The build must be deterministic: two calls with the same arguments give two instances
of one mechanism (the same strategy, bit for bit), so one can resume the other.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

from cocoon_ckpt.dp.noise_mechanism import NoiseMechanism
from cocoon_ckpt.dp.ring import HostRing
from cocoon_ckpt.errors import StateSchemaError

__all__ = ["NoiseMechanismTests"]

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


def _steps(noise: NoiseMechanism, n: int) -> list[torch.Tensor]:
    return [noise.step() for _ in range(n)]


def _copied(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with its live rows copied into a host ring (what a checkpoint keeps)."""
    return {**state, "ring": HostRing.holding(state["ring"].gather())}


class NoiseMechanismTests:
    """The conformance suite. A subclass supplies `build`; it may change `dim`, `std`
    and `steps` (more steps than the mechanism has rows, so a ring wraps)."""

    #: m, the whole dimension; more than one 65,536-coordinate block is not needed
    #: here (I1's block split has its own tests), an odd size is.
    dim = 701
    #: sigma * clip.
    std = 1.3
    #: Steps each test runs in all, past the rows of the mechanism under test and at
    #: most its n (a column-normalized C has no step n).
    steps = 12

    def build(
        self, *, key: bytes, dtype: str, start: int = 0, stop: int | None = None
    ) -> NoiseMechanism:
        """Override: a fresh instance over `dim` for the shard [start, stop)."""
        raise NotImplementedError("a NoiseMechanismTests subclass must override build")

    # the contract's shape -------------------------------------------------------------
    def test_is_a_noise_mechanism(self) -> None:
        noise = self.build(key=KEY, dtype="float32", start=5, stop=400)
        assert isinstance(noise, NoiseMechanism)
        assert (noise.start, noise.stop, noise.width, noise.t) == (5, 400, 395, 0)
        rows = noise.state_rows
        assert rows.width == 395 and rows.dtype == np.dtype(np.float32)
        assert noise.dtype == torch.float32
        assert noise.history_bytes() == rows.nbytes == rows.slots * 395 * 4
        assert noise.row_steps() == [None] * rows.slots
        assert isinstance(noise.persistent_rows, bool)
        noise.close()
        noise.close()  # idempotent

    def test_step_count_and_labels(self) -> None:
        noise = self.build(key=KEY, dtype="float32")
        for t in range(self.steps):
            assert noise.t == t and noise.state_dict()["t"] == t
            w = noise.step()
            assert w.shape == (self.dim,) and w.dtype == torch.float32
            labels = noise.row_steps()
            assert len(labels) == noise.state_rows.slots
            # a row holds state of a step already taken, never of a later one
            assert all(s is None or 0 <= s <= t for s in labels)
            if not noise.persistent_rows:
                assert labels == [t] * len(labels)
        assert noise.t == self.steps

    def test_deterministic_under_a_key(self) -> None:
        a, b = (self.build(key=KEY, dtype="float32") for _ in range(2))
        other = self.build(key=OTHER_KEY, dtype="float32")
        for wa, wb, wo in zip(
            _steps(a, self.steps), _steps(b, self.steps), _steps(other, self.steps), strict=True
        ):
            assert torch.equal(wa, wb)
            assert not torch.equal(wa, wo)
        assert np.array_equal(a.state_rows.gather(), b.state_rows.gather())

    def test_shards_join_to_the_whole(self) -> None:
        whole = self.build(key=KEY, dtype="float32")
        cuts = [0, 1, 300, self.dim]
        shards = [
            self.build(key=KEY, dtype="float32", start=a, stop=z)
            for a, z in itertools.pairwise(cuts)
        ]
        for _ in range(self.steps):
            assert torch.equal(torch.cat([s.step() for s in shards]), whole.step())

    def test_is_the_dense_solve(self) -> None:
        noise = self.build(key=KEY, dtype="float64")
        want = noise.materialize(self.steps)
        got = torch.stack(_steps(noise, self.steps))
        assert want.shape == (self.steps, self.dim)
        assert torch.allclose(got, want, rtol=0, atol=1e-11 * float(want.abs().max()))

    def test_materialize_leaves_the_state(self) -> None:
        noise = self.build(key=KEY, dtype="float32")
        _steps(noise, 3)
        before = _copied(noise.state_dict())
        noise.materialize(self.steps)
        after = noise.state_dict()
        assert after["t"] == before["t"] == 3
        assert np.array_equal(after["ring"].gather(), before["ring"].gather())

    def test_regenerated_rows_are_the_rows_held(self) -> None:
        """The audit's regeneration at a few coordinates (any order, any shard's) gives
        every row as an instance held it after each step, bit for bit."""
        start, stop = 40, 600
        noise = self.build(key=KEY, dtype="float32", start=start, stop=stop)
        coords = np.array([599, 41, 300, 40, 77], dtype=np.int64)
        held = {}
        for t in range(self.steps):
            noise.step()
            held[t] = noise.state_rows.gather()[:, coords - start]
        rows = noise.state_rows.gather()
        every = [(slot, t) for t in range(self.steps) for slot in range(len(held[t]))]
        got = noise.regenerate_rows(coords, every)
        assert got.keys() == set(every)
        assert all(np.array_equal(got[(s, t)], held[t][s]) for s, t in every)
        if every:
            assert noise.regenerate_rows(coords, [every[-1]]).keys() == {every[-1]}
        assert noise.t == self.steps and np.array_equal(noise.state_rows.gather(), rows)

    # state ----------------------------------------------------------------------------
    @pytest.mark.parametrize("taken", [0, 1, 3, 7])
    def test_resume_from_state_dict_is_bit_exact(self, taken: int) -> None:
        ran = self.build(key=KEY, dtype="float32")
        _steps(ran, taken)
        state = _copied(ran.state_dict())
        resumed = self.build(key=KEY, dtype="float32")
        resumed.load_state_dict(state)
        assert resumed.t == taken
        rest = self.steps - taken
        for wa, wb in zip(_steps(ran, rest), _steps(resumed, rest), strict=True):
            assert torch.equal(wa, wb)

    def test_resume_onto_another_split_is_bit_exact(self) -> None:
        """Rows are per coordinate: a state cut for another shard resumes it."""
        ran = self.build(key=KEY, dtype="float64")
        _steps(ran, 5)
        state = ran.state_dict()
        rows = state["ring"].gather()
        shard = self.build(key=KEY, dtype="float64", start=100, stop=250)
        shard.load_state_dict(
            {**state, "start": 100, "stop": 250, "ring": HostRing.holding(rows[:, 100:250].copy())}
        )
        for _ in range(self.steps - 5):
            assert torch.equal(shard.step(), ran.step()[100:250])

    def test_state_round_trips(self) -> None:
        ran = self.build(key=KEY, dtype="float64")
        _steps(ran, 5)
        state = _copied(ran.state_dict())
        loaded = self.build(key=KEY, dtype="float64")
        loaded.load_state_dict(state)
        again = loaded.state_dict()
        fields = ("kind", "schema_version", "t", "start", "stop", "dtype", "slot_steps")
        assert {k: again[k] for k in fields} == {k: state[k] for k in fields}
        assert again["persistent_rows"] is loaded.persistent_rows is state["persistent_rows"]
        assert again["dtype"] == "float64" and again["slot_steps"] == loaded.row_steps()
        assert np.array_equal(again["ring"].gather(), state["ring"].gather())

    def test_persistent_rows_keep_their_values(self) -> None:
        """A persistent row keeps its values while its label stands (a checkpoint may
        borrow it from the parent version); other rows all carry the last step."""
        noise = self.build(key=KEY, dtype="float32")
        for _ in range(self.steps):
            labels = noise.row_steps()
            rows = noise.state_rows.gather()
            noise.step()
            after = noise.state_rows.gather()
            for slot, (was, now) in enumerate(zip(labels, noise.row_steps(), strict=True)):
                if noise.persistent_rows and was is not None and was == now:
                    assert np.array_equal(after[slot], rows[slot])
                if not noise.persistent_rows:
                    assert now == noise.t - 1

    def test_refuses_another_state_and_loads_nothing(self) -> None:
        ran = self.build(key=KEY, dtype="float32")
        _steps(ran, 4)
        good = _copied(ran.state_dict())
        target = self.build(key=KEY, dtype="float32")
        _steps(target, 2)
        before = target.state_rows.gather()
        rows = good["ring"].gather()
        wrong: list[tuple[dict[str, Any], type[Exception]]] = [
            ({**good, "kind": "NotThisNoise"}, StateSchemaError),
            ({**good, "schema_version": good["schema_version"] + 1}, StateSchemaError),
            ({**good, "start": 1}, ValueError),
            (
                {
                    **good,
                    "ring": HostRing.holding(
                        np.zeros((rows.shape[0] + 1, rows.shape[1]), np.float32)
                    ),
                },
                ValueError,
            ),
            ({**good, "ring": HostRing.holding(rows.astype(np.float64))}, ValueError),
            ({**good, "ring": rows}, TypeError),
        ]
        for state, error in wrong:
            with pytest.raises(error):
                target.load_state_dict(state)
            assert target.t == 2
            assert np.array_equal(target.state_rows.gather(), before)
