"""Large staged files are written with O_DIRECT from an aligned bounce buffer where the
filesystem takes it, and through the page cache from wherever it refuses; either way the
bytes are those of the buffered write and every file is fsynced before the commit."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from state import Store, arrays, file_writes

_SIZES = st.lists(st.integers(0, 3 * 4096 + 7), min_size=1, max_size=4)


def _parts(sizes: list[int]) -> list[bytes]:
    return [bytes((i * 31 + j * 7) % 251 for j in range(n)) for i, n in enumerate(sizes)]


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("c.*"))  # chunks: manifests carry the time and the lease
    }


def _version(url: str) -> None:
    store = Store.open(url)
    store.acquire_lease()
    txn = store.begin(3)
    txn.put_array("ring/w", np.arange(5 * 3001, dtype=np.float32).reshape(5, 3001))
    txn.put_array("model/fc.weight", np.linspace(-1, 1, 9999, dtype=np.float64))
    txn.put_array("model/fc.bias", np.ones(3, dtype=np.float32))
    txn.commit()
    store.release_lease()


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Direct writes from files of 8 KiB up, in 8 KiB pieces: many whole pieces, ragged
    tails, and chunks that stay below the threshold."""
    monkeypatch.setattr(arrays, "CHUNK_BYTES", 20_000)
    monkeypatch.setattr(file_writes, "DIRECT_BYTES", 8192)
    monkeypatch.setattr(file_writes, "_DIRECT_PIECE", 8192)
    monkeypatch.setattr(file_writes, "PACE_BYTES", 4096)
    monkeypatch.setattr(file_writes, "_PACE_WINDOW", 1)


def _spy_direct(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record every O_DIRECT write's length (the fd's flags checked at the write)."""
    seen: list[int] = []
    real = file_writes.os.pwrite

    def pwrite(fd: int, data: memoryview, at: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            seen.append(len(data))
        return real(fd, data, at)

    monkeypatch.setattr(file_writes.os, "pwrite", pwrite)
    return seen


@pytest.mark.usefixtures("small_pieces")
@pytest.mark.parametrize("where", ["tmp_path", "/dev/shm"])
def test_a_direct_version_holds_the_buffered_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """On the test disk and on tmpfs (which takes O_DIRECT on this kernel, or refuses it
    on older ones: either way the chunks are the buffered ones)."""
    base = tmp_path if where == "tmp_path" else Path(where)
    root = Path(os.path.realpath(base)) / f"direct-{os.getpid()}-{tmp_path.name}"
    try:
        monkeypatch.setattr(file_writes, "DIRECT_BYTES", 0)
        monkeypatch.setattr(file_writes, "PACE_BYTES", 0)
        _version(str(tmp_path / "buffered.zarr"))
        monkeypatch.setattr(file_writes, "DIRECT_BYTES", 8192)
        monkeypatch.setattr(file_writes, "PACE_BYTES", 4096)
        seen = _spy_direct(monkeypatch)
        _version(str(root / "direct.zarr"))
        buffered, direct = _files(tmp_path / "buffered.zarr"), _files(root / "direct.zarr")
        assert len(buffered) > 4 and buffered == direct
        if where == "tmp_path":  # ext4/xfs take O_DIRECT: whole pieces and padded tails
            assert 8192 in seen and any(n % 4096 == 0 and n < 8192 for n in seen)
        v = Store.open(str(root / "direct.zarr"), create=False).latest()
        assert v is not None
        np.testing.assert_array_equal(v.array("model/fc.weight"), np.linspace(-1, 1, 9999))
    finally:
        shutil.rmtree(root, ignore_errors=True)


@given(sizes=_SIZES, piece=st.sampled_from([4096, 8192, 12288]))
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_direct_write_writes_every_part_in_order(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    sizes: list[int],
    piece: int,
) -> None:
    monkeypatch.setattr(file_writes, "_DIRECT_PIECE", piece)
    parts = _parts(sizes)
    path = tmp_path_factory.mktemp("d") / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        file_writes._write_direct(fd, [memoryview(p) for p in parts], sum(sizes))
        os.fsync(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(parts)


@given(
    sizes=_SIZES,
    refuse_at=st.integers(0, 4),
    how=st.sampled_from(["einval", "short"]),
    short_by=st.integers(1, 4095),
)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_a_refused_direct_write_goes_on_through_the_page_cache(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    sizes: list[int],
    refuse_at: int,
    how: str,
    short_by: int,
) -> None:
    """The `refuse_at`-th direct write fails with EINVAL (a filesystem that takes the
    flag but not the alignment) or writes `short_by` bytes less than asked (really, to
    the file): the rest is written buffered from where it stopped and the file is the
    parts' bytes, its size exact."""
    monkeypatch.setattr(file_writes, "_DIRECT_PIECE", 4096)
    monkeypatch.setattr(file_writes, "PACE_BYTES", 1000)
    monkeypatch.setattr(file_writes, "_PACE_WINDOW", 1)
    calls = [0]
    real = os.pwrite

    def pwrite(fd: int, data: memoryview, at: int) -> int:
        direct = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        calls[0] += 1
        if direct and calls[0] - 1 == refuse_at:
            if how == "einval":
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            return real(fd, data[: max(0, len(data) - short_by)], at)
        return real(fd, data, at)

    monkeypatch.setattr(file_writes.os, "pwrite", pwrite)
    parts = _parts(sizes)
    path = tmp_path_factory.mktemp("r") / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        file_writes._write_direct(fd, [memoryview(p) for p in parts], sum(sizes))
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT or calls[0] <= refuse_at
        os.fsync(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(parts)


@pytest.mark.usefixtures("small_pieces")
def test_a_filesystem_refusing_o_direct_gets_the_paced_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fcntl refuses O_DIRECT (as tmpfs did before Linux 6.6): nothing is written
    direct, the chunks are the buffered ones."""
    real = fcntl.fcntl

    def refusing(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, cmd, arg)

    monkeypatch.setattr(file_writes.fcntl, "fcntl", refusing)
    seen = _spy_direct(monkeypatch)
    paced: list[int] = []
    real_paced = file_writes._write_paced

    def spy_paced(fd: int, parts: list[memoryview], pace: int, *, start: int = 0) -> None:
        paced.append(pace)
        real_paced(fd, parts, pace, start=start)

    monkeypatch.setattr(file_writes, "_write_paced", spy_paced)
    _version(str(tmp_path / "refused.zarr"))
    monkeypatch.setattr(file_writes, "DIRECT_BYTES", 0)
    monkeypatch.setattr(file_writes, "PACE_BYTES", 0)
    _version(str(tmp_path / "buffered.zarr"))
    assert seen == [] and paced
    assert _files(tmp_path / "refused.zarr") == _files(tmp_path / "buffered.zarr")


@pytest.mark.usefixtures("small_pieces")
def test_direct_files_are_still_fsynced_before_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """O_DIRECT bypasses the page cache, not the disk's cache nor the file's metadata:
    every file is still fsynced before the manifest is created."""
    events: list[str] = []
    real_fsync, real_link = os.fsync, os.link

    def fsync(fd: int) -> None:
        events.append("fsync " + os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def link(src: str, dst: str) -> None:
        events.append("link " + str(dst))
        real_link(src, dst)

    monkeypatch.setattr(file_writes.os, "fsync", fsync)
    monkeypatch.setattr(file_writes.os, "link", link)
    seen = _spy_direct(monkeypatch)
    _version(str(tmp_path / "s.zarr"))
    assert seen
    manifest = next(i for i, e in enumerate(events) if e.startswith("link ") and "manifests" in e)
    synced = {e[len("fsync ") :] for e in events[:manifest] if e.startswith("fsync ")}
    chunks = {str(p) for p in (tmp_path / "s.zarr").rglob("c.*")}
    assert chunks and chunks <= synced
