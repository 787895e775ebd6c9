"""The `NoiseMechanism` conformance suite (`cocoon_ckpt.dp.testing.noise_tests`) on
every implementation and kind the factory builds, and the factory itself: the only
place that tells BandMF's noise from a BLT's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from cocoon_ckpt.dp.bandmf_noise import BandMFNoise
from cocoon_ckpt.dp.blt.noise import BLTNoise
from cocoon_ckpt.dp.blt.optimize import rational_approx_blt
from cocoon_ckpt.dp.generator import NoiseRng
from cocoon_ckpt.dp.mechanism import BandMF, MechanismKind
from cocoon_ckpt.dp.noise_mechanism import NoiseMechanism
from cocoon_ckpt.dp.ring import HostRing
from cocoon_ckpt.dp.testing.noise_tests import KEY, NoiseMechanismTests
from cocoon_ckpt.errors import ConfigError, StateSchemaError
from cocoon_ckpt.train.mechanisms import build_mechanism, build_noise, tables_mechanism
from tests.cocoon_ckpt.conftest import job_config

STEPS = 12
GOLDEN = Path(__file__).parent / "golden" / "format_store"


class TestBandMFOptimized(NoiseMechanismTests):
    def build(
        self, *, key: bytes, dtype: str, start: int = 0, stop: int | None = None
    ) -> NoiseMechanism:
        mech = BandMF.optimized(4, STEPS)
        return BandMFNoise(mech, self.dim, key, self.std, dtype, start=start, stop=stop)


class TestBandMFColumnNormalized(NoiseMechanismTests):
    """The tail's per-step scale s_t (t > n - b) runs inside the suite's 12 steps."""

    def build(
        self, *, key: bytes, dtype: str, start: int = 0, stop: int | None = None
    ) -> NoiseMechanism:
        mech = BandMF.optimized_colnorm(5, STEPS)
        return BandMFNoise(mech, self.dim, key, self.std, dtype, start=start, stop=stop)


class TestBandMFSecureGenerator(NoiseMechanismTests):
    def build(
        self, *, key: bytes, dtype: str, start: int = 0, stop: int | None = None
    ) -> NoiseMechanism:
        mech = BandMF.banded_sqrt(3, STEPS)
        return BandMFNoise(
            mech, self.dim, key, self.std, dtype, start=start, stop=stop, rng=NoiseRng.SECURE
        )


class TestBLT(NoiseMechanismTests):
    def build(
        self, *, key: bytes, dtype: str, start: int = 0, stop: int | None = None
    ) -> NoiseMechanism:
        blt = rational_approx_blt(3, STEPS)
        return BLTNoise(blt, self.dim, key, self.std, dtype, start=start, stop=stop)


class TestFactoryBuilt(NoiseMechanismTests):
    """What the trainer runs, through the one factory, for the BLT kind (a fitted one)."""

    def build(
        self, *, key: bytes, dtype: str, start: int = 0, stop: int | None = None
    ) -> NoiseMechanism:
        base = job_config("mlp", bands=4, steps=STEPS)
        dp = dataclasses.replace(base.dp, mechanism=MechanismKind.BLT)
        return build_noise(
            build_mechanism(dp),
            self.dim,
            key,
            self.std,
            dtype,
            start=start,
            stop=self.dim if stop is None else stop,
            tiers=None,
            rng=NoiseRng.DEFAULT,
        )


@pytest.mark.parametrize("kind", [k for k in MechanismKind if k is not MechanismKind.CUSTOM])
def test_the_factory_builds_a_noise_mechanism_for_every_kind(kind: MechanismKind) -> None:
    base = job_config("mlp", bands=4, steps=STEPS)
    dp = dataclasses.replace(base.dp, mechanism=kind)
    mechanism = build_mechanism(dp)
    noise = build_noise(
        mechanism, 50, KEY, 1.0, "float32", start=0, stop=50, tiers=None, rng=NoiseRng.DEFAULT
    )
    assert isinstance(noise, NoiseMechanism)
    # the rows the checkpoint stores: b - 1 ring slots, or d BLT buffers
    rows = mechanism.buffers if kind is MechanismKind.BLT else dp.bands - 1  # type: ignore[union-attr]
    assert noise.state_rows.slots == rows
    assert noise.persistent_rows is (kind is not MechanismKind.BLT)
    if kind is MechanismKind.BLT:
        with pytest.raises(ConfigError, match="embedding tables"):
            tables_mechanism(mechanism)
    else:
        assert tables_mechanism(mechanism) is mechanism
    noise.close()


def test_each_refuses_the_others_state() -> None:
    """A BandMF state is not a BLT's, even with rows of the same shape."""
    band = BandMFNoise(BandMF.optimized(4, STEPS), 60, KEY, 1.0)
    blt = BLTNoise(rational_approx_blt(3, STEPS), 60, KEY, 1.0)
    assert band.state_rows.slots == blt.state_rows.slots == 3
    for a, b in ((band, blt), (blt, band)):
        a.step()
        state = {**a.state_dict(), "ring": HostRing.holding(a.state_rows.gather())}
        before = b.state_rows.gather()
        with pytest.raises(StateSchemaError, match="state_dict"):
            b.load_state_dict(state)
        assert b.t in (0, 1) and np.array_equal(b.state_rows.gather(), before)


def test_the_noise_kind_is_never_stored() -> None:
    """Renaming CorrelatedNoise to BandMFNoise changes no stored byte: a version records
    the mechanism (`BandMF`, `BLT`) and the noise's rows, never its noise class's kind,
    so stores written before the rename load unchanged (test_format_golden decodes the
    golden store written by the codec of that time)."""
    files = [p for p in GOLDEN.rglob("*") if p.is_file()]
    text = b"".join(p.read_bytes() for p in files)
    assert any(p.parent.name == "manifests" for p in files) and b'"BandMF"' in text
    for kind in (b"CorrelatedNoise", b"BandMFNoise", b"BLTNoise"):
        assert kind not in text
