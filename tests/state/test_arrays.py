"""The direct chunk path writes and reads exactly zarr v3's bytes + crc32c format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from zarr.codecs import Crc32cCodec

from state import arrays
from state.checksum import array_checksum
from state.open import open_backend

DTYPES = st.sampled_from([np.float32, np.float64, np.int64, np.int8, np.uint8, np.bool_])


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arrays, "CHUNK_BYTES", 64)  # many chunks and ragged edge chunks


@given(
    arr=hnp.arrays(
        dtype=DTYPES, shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9)
    )
)
def test_zarr_reads_what_we_write(
    tmp_path_factory: pytest.TempPathFactory, arr: np.ndarray
) -> None:
    backend = open_backend(str(tmp_path_factory.mktemp("w")))
    arrays.ensure_groups(backend, "g", "a", set())
    checksum, chunks = arrays.write_array(backend, "g", "a", arr)
    assert checksum == array_checksum(arr)
    theirs = np.asarray(
        zarr.open_array(zarr.storage.LocalStore(backend.path("g")), path="a", mode="r")[...]
    )
    assert theirs.shape == arr.shape and theirs.tobytes() == arr.tobytes()
    ours, crc = arrays.read_array(backend, "g", "a")
    assert ours.dtype == arr.dtype and ours.tobytes() == arr.tobytes() and crc == checksum
    # with the layout the manifest records, zarr.json is not even read
    layout = (arr.shape, str(arr.dtype), chunks)
    known, crc2 = arrays.read_array(backend, "g", "a", layout, arrays.CHUNK_SEPARATOR)
    assert known.tobytes() == arr.tobytes() and crc2 == checksum


@given(arr=hnp.arrays(dtype=DTYPES, shape=hnp.array_shapes(min_dims=1, max_dims=2, max_side=9)))
def test_we_read_what_zarr_writes(
    tmp_path_factory: pytest.TempPathFactory, arr: np.ndarray
) -> None:
    root = tmp_path_factory.mktemp("z")
    zarr.create_array(
        zarr.storage.LocalStore(str(root / "g")),
        name="a",
        data=arr,
        chunks=(2, *arr.shape[1:]) if arr.ndim > 1 else (2,),
        filters=None,
        compressors=[Crc32cCodec()],
        fill_value=0,
        config={"write_empty_chunks": True},
    )
    got, crc = arrays.read_array(open_backend(str(root)), "g", "a")
    assert got.tobytes() == arr.tobytes() and crc == array_checksum(arr)
    # zarr's default keys `c/0/0` are format 2's: read from a manifest's layout too
    layout = (arr.shape, str(arr.dtype), (2, *arr.shape[1:]))
    got, crc = arrays.read_array(open_backend(str(root)), "g", "a", layout, "/")
    assert got.tobytes() == arr.tobytes() and crc == array_checksum(arr)


def test_damaged_chunks_raise(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path))
    arrays.ensure_groups(backend, "g", "a", set())
    arrays.write_array(backend, "g", "a", np.arange(100, dtype=np.float64))
    chunk = tmp_path / "g" / "a" / "c.3"
    data = bytearray(chunk.read_bytes())
    data[2] ^= 1
    chunk.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"c\.3 .*crc32c"):
        arrays.read_array(backend, "g", "a")
    chunk.write_bytes(bytes(data[:-3]))
    with pytest.raises(ValueError, match="torn"):
        arrays.read_array(backend, "g", "a")
    chunk.unlink()
    with pytest.raises(FileNotFoundError):
        arrays.read_array(backend, "g", "a")


def test_memory_backend_uses_the_same_format() -> None:
    backend = open_backend("memory://arrays-fmt")
    arr = np.arange(50, dtype=np.float32).reshape(10, 5)
    arrays.ensure_groups(backend, "g", "a", set())
    arrays.write_array(backend, "g", "a", arr)
    theirs = zarr.open_array(backend.zarr_store("g"), path="a", mode="r")[...]
    np.testing.assert_array_equal(theirs, arr)
    np.testing.assert_array_equal(arrays.read_array(backend, "g", "a")[0], arr)


def test_a_whole_store_is_a_valid_zarr_hierarchy(tmp_path: Path) -> None:
    from state import Store

    store = Store.open(str(tmp_path / "s.zarr"))
    store.acquire_lease()
    txn = store.begin(3)
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    txn.put_array("ring/shard-0000/w-00000002", w)
    txn.put_array("model/fc.weight", np.ones(5))
    man = txn.commit()
    root = zarr.open_group(zarr.storage.LocalStore(str(tmp_path / "s.zarr")), mode="r")
    node = root[man.arrays["ring/shard-0000/w-00000002"].path]
    np.testing.assert_array_equal(node[...], w)
    folder = man.arrays["model/fc.weight"].path.rsplit("/", 2)[0]
    assert isinstance(root[folder], zarr.Group) and isinstance(root[f"{folder}/ring"], zarr.Group)
