"""Any zarr v3 client reads every array: zarr-python, tensorstore and xarray open what a
real job wrote (model, ring, CSC, noise order, RNG state) and what `write_array` writes
for every dtype it accepts, and read the values the store's own verified read returns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorstore as ts
import xarray as xr
import zarr

from cocoon_ckpt import DPConfig, JobConfig, run_job
from cocoon_ckpt.embedding import EmbeddingConfig, TableMode
from cocoon_ckpt.train.options import JobOptions
from state import Store, Version, arrays
from state.open import open_backend
from tests.cocoon_ckpt.conftest import job_config


def _tensorstore(path: Path) -> np.ndarray:
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
    return np.asarray(ts.open(spec, open=True, read=True).result().read().result())


def _zarr(root: Path, path: str) -> np.ndarray:
    return np.asarray(zarr.open_array(zarr.storage.LocalStore(str(root)), path=path, mode="r")[...])


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


CASES = {
    "f32": np.arange(12, dtype=np.float32).reshape(4, 3),
    "f16": np.linspace(-2, 2, 10, dtype=np.float16),
    "c64": (np.arange(10) * (1 - 2j)).astype(np.complex64).reshape(5, 2),
    "c128": np.array([1.5 + 2.5j, -3j, 0j]),
    "bool": np.array([[True, False], [False, True], [True, True]]),
    "i8": np.arange(-5, 5, dtype=np.int8),
    "u64": np.arange(8, dtype=np.uint64).reshape(2, 2, 2),
    "scalar": np.array(3.25),
    "empty": np.zeros((0, 3), dtype=np.float64),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_dtype_we_write_opens_in_zarr_and_tensorstore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Complex arrays once carried `fill_value: 0.0`, which both clients refuse (zarr v3
    spells a complex fill as [real, imag]); ragged edge chunks, 0-d and empty arrays."""
    monkeypatch.setattr(arrays, "CHUNK_BYTES", 24)  # several chunks, a padded edge chunk
    arr = CASES[name]
    backend = open_backend(str(tmp_path))
    arrays.ensure_groups(backend, "g", name, set())
    arrays.write_array(backend, "g", name, arr)
    meta = json.loads((tmp_path / "g" / name / "zarr.json").read_text())
    assert meta["dimension_names"] == [f"{name}:{i}" for i in range(arr.ndim)]
    assert _same(_zarr(tmp_path / "g", name), arr)
    assert _same(_tensorstore(tmp_path / "g" / name), arr)


def test_refused_dtypes_and_dimension_names_write_nothing(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path))
    with pytest.raises(TypeError, match=r"g/when: dtype datetime64\[s\] is not a zarr v3"):
        arrays.write_array(backend, "g", "when", np.array(["2026-01-01"], "datetime64[s]"))
    with pytest.raises(ValueError, match=r"g/w: dimension_names=\['slot'\] must hold one"):
        arrays.write_array(backend, "g", "w", np.zeros((2, 3)), dimension_names=["slot"])
    assert not (tmp_path / "g").exists()
    arrays.ensure_groups(backend, "g", "w", set())
    arrays.write_array(backend, "g", "w", np.zeros((2, 3)), dimension_names=["slot", "param"])
    assert xr.open_zarr(str(tmp_path / "g"), consolidated=False)["w"].dims == ("slot", "param")


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A short dense job (mlp) and a DLRM job with coalesced embedding noise."""
    root = tmp_path_factory.mktemp("clients")
    dlrm = JobConfig(
        job="example:dlrm",
        dp=DPConfig(steps=6, batch_size=12, dataset_size=360, noise_multiplier=1.0, bands=3),
        options={"tables": [90, 40, 7], "dim": 3, "dense": 4, "dtype": "float64"},
        checkpoint_every=4,
        embedding=EmbeddingConfig(
            mode=TableMode.COALESCED, threat_model="final_model", hot_threshold=2
        ),
    )
    configs = {"mlp": job_config("mlp", bands=3, steps=6), "dlrm": dlrm}
    for name, cfg in configs.items():
        run_job(cfg, str(root / name), options=JobOptions(key_file=str(root / f"{name}.key")))
    return {name: root / name for name in configs}


@pytest.mark.parametrize("job", ["mlp", "dlrm"])
def test_zarr_and_tensorstore_read_every_array_of_a_real_store(
    stores: dict[str, Path], job: str
) -> None:
    root = stores[job]
    store = Store.open(str(root), create=False)
    group = zarr.open_group(zarr.storage.LocalStore(str(root)), mode="r")
    seen: dict[str, str] = {}
    for v in store.versions():
        ver = Version(store, store.manifest(v))
        for name, meta in ver.manifest.arrays.items():
            if meta.path in seen:
                continue
            ours = ver.array(name)  # verified: every chunk's crc and the manifest checksum
            node: Any = group[meta.path]  # reached through the hierarchy: parents are groups
            assert isinstance(node, zarr.Array), meta.path
            assert _same(np.asarray(node[...]), ours), meta.path
            assert _same(_tensorstore(root / meta.path), ours), meta.path
            seen[meta.path] = name
    kinds = {
        n.split("/")[0] if not n.startswith("emb/") else n.split("/")[2] for n in seen.values()
    }
    # the generators' states are packed into the rng record (no zarr client reads them)
    want = {"model", "ring"} | ({"csc", "order", "ring"} if job == "dlrm" else set())
    assert want <= kinds
    if job == "dlrm":  # tables' CSC and noise order are job-lifetime arrays under shared/
        assert any(p.startswith("shared/") and p.endswith("/csc/values") for p in seen)
    # only versions/ and shared/ are zarr nodes; leases/, manifests/ (and secret/) are not
    assert {k for k, _ in group.members()} == {"versions", "shared"}
    # nothing writes consolidated metadata, so none can go stale
    assert not any("consolidated_metadata" in p.read_text() for p in root.rglob("zarr.json"))


def test_xarray_opens_every_group_of_arrays(stores: dict[str, Path]) -> None:
    """xarray needs `dimension_names`, and one size per dimension name in a group: the
    model group (weights and biases of many sizes) and every ring group open."""
    root = stores["dlrm"]
    groups = {p.parent.parent for p in root.rglob("zarr.json") if '"array"' in p.read_text()}
    assert len(groups) >= 5
    for g in sorted(groups):
        ds = xr.open_zarr(str(root), group=str(g.relative_to(root)), consolidated=False)
        for name, var in ds.data_vars.items():
            assert var.dims == tuple(f"{name}:{i}" for i in range(var.ndim))
