"""The noise key's one home: where it lives, how it is read, made and named.

The key is 32 secret bytes; whoever holds it (and the stored history) can subtract the
noise (I6). It lives either in the store (`secret/noise.key`, 0600 in a 0700 folder) or,
with `key_file`, in a file of the user's that must be readable by its owner only.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
from collections.abc import Iterator

from cocoon_ckpt.errors import NoiseKeyError
from cocoon_ckpt.layout import KEY_SECRET
from state import Manifest, Store, StoreError
from state.paths import manifest_path
from state.root import enclosing_store

__all__ = [
    "KEY_BYTES",
    "check_key_file_place",
    "create_key_file",
    "key_id",
    "key_location",
    "load_key",
    "manifest_mac_key",
    "tile_mac_key",
    "sealed_under",
    "wrong_key",
    "new_key",
    "read_key_file",
    "save_key",
]

KEY_BYTES = 32


def key_id(key: bytes) -> str:
    """A public id of the noise key (keyed hash): tells keys apart, reveals nothing."""
    return hashlib.blake2b(b"cocoon-key-id", key=key, digest_size=8).hexdigest()


def manifest_mac_key(key: bytes) -> bytes:
    """The key that MACs the job's manifests (`state.Store.authenticate_with`), derived
    from the noise key by keyed BLAKE2b under its own personalisation: a MAC reveals
    nothing of the noise key, and no other use of the key (its id, the noise) can stand
    in for it."""
    return hashlib.blake2b(b"", key=key, person=b"cc-manifest-key", digest_size=32).digest()


def tile_mac_key(key: bytes) -> bytes:
    """The key that MACs the embedding precompute's kept tiles (`embedding.stored_tiles`),
    derived from the noise key under its own personalisation, apart from the
    manifests' (`manifest_mac_key`)."""
    return hashlib.blake2b(b"", key=key, person=b"cc-precomp-tile", digest_size=32).digest()


def _manifests_unverified(store: Store, below: int | None = None) -> Iterator[Manifest]:
    """`store`'s readable manifests (older than `below`, when given), newest first,
    checked by their checksums only: read here without the store's own authentication,
    which a caller asking why it failed has set."""
    for v in reversed(store.versions()):
        if below is not None and v >= below:
            continue
        try:
            data = store.backend.read_bytes(manifest_path(v))
            yield Manifest.from_bytes(data, version=v, where=store.url)
        except (OSError, StoreError):
            continue


def sealed_under(store: Store, key: bytes, *, below: int | None = None) -> int | None:
    """The newest version of `store` (older than `below`, when given) whose MACs verify
    under the job's `key`, or None. An unsealed version newer than a sealed one had
    its MACs stripped: a format-4 writer seals every version it commits, and a store
    written before format 4 is sealed from its first resume on."""
    mac_key = manifest_mac_key(key)
    for m in _manifests_unverified(store, below):
        if m.sealed:
            try:
                m.authenticate(mac_key, where=store.url)
            except StoreError:
                continue
            return m.version
    return None


def wrong_key(store: Store, key: bytes) -> NoiseKeyError | None:
    """Why versions fail their MACs under `key` when it is another job's key: no version
    verifies under it, and the newest readable version names another `key_id`. None
    when some version verifies (the key is the job's: a failing version is forged) or
    nothing says the key differs."""
    if sealed_under(store, key) is not None:
        return None
    newest = next(_manifests_unverified(store), None)
    if newest is None or newest.records.get("key_id") == key_id(key):
        return None
    return NoiseKeyError(
        f"{store.url}: the noise key given does not match the key of version "
        f"{newest.version} (key id {key_id(key)}, the version's "
        f"{newest.records.get('key_id')}) and no version verifies under it: it is another "
        "job's key. Use the job's own key (--key-file / key_file=)"
    )


def new_key() -> bytes:
    """A fresh random key (not yet stored anywhere: see `save_key`)."""
    return secrets.token_bytes(KEY_BYTES)


def key_location(key_file: str | None) -> str:
    """What a version records as the key's location."""
    return "key_file" if key_file else f"store:secret/{KEY_SECRET}"


def check_key_file_place(key_file: str, store_url: str) -> None:
    """Refuse a key file inside a store's tree: the store's own (`store_url`, existing or
    about to be created) or any other cocoon-ckpt store above it. A store's retention and
    gc delete the files its manifests do not name, the key with them, and a store whose
    key is gone can neither resume nor be audited. Local paths only: whether an object
    store's URL and a local file overlap is not asked (they cannot).

    A key file that does not exist yet must have a folder to be created in.

    Raises:
        NoiseKeyError: naming the key file, the store (or its missing folder) and the
            fix.
    """
    where = os.path.realpath(key_file)
    inside = enclosing_store(where)
    own = _local_path(store_url)
    if inside is None and own is not None:
        root = os.path.realpath(own)
        if where == root or where.startswith(root.rstrip(os.sep) + os.sep):
            inside = root
    if inside is not None:
        raise NoiseKeyError(
            f"--key-file {key_file} lies inside the store {inside}, whose retention and gc "
            "delete files its manifests do not name (the key with them: the job could then "
            "neither resume nor be audited); nothing was written: keep the key file outside "
            "every store"
        )
    folder = os.path.dirname(os.path.abspath(key_file))
    if not os.path.exists(key_file) and not os.path.isdir(folder):
        raise NoiseKeyError(
            f"--key-file {key_file}: its folder {folder} does not exist, so a new job's key "
            "could not be kept; nothing was written: create the folder (mkdir -p), or name "
            "a key file in an existing one"
        )


def _local_path(url: str) -> str | None:
    """The local path of a store URL (a plain path or `file://`), or None for others."""
    if url.startswith("file://"):
        return url[len("file://") :]
    return None if "://" in url or "::" in url else url


def read_key_file(path: str) -> bytes:
    """The key in `path`, which must be a 32-byte file readable by its owner only.

    Raises:
        NoiseKeyError: the file is missing or unreadable, readable by group or others,
            or not 32 bytes.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not hang us
    except FileNotFoundError:
        raise NoiseKeyError(
            f"cannot read key file: {path} does not exist; pass the job's key file"
        ) from None
    except OSError as exc:
        raise NoiseKeyError(
            f"cannot read key file {path} ({exc.strerror}); pass the job's key file"
        ) from None
    st = os.fstat(fd)  # the file opened, not whatever the name points to now
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)  # (a folder cannot even be wrapped in a file object)
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise NoiseKeyError(
            f"key file {path} is {kind}; pass the job's key file (a {KEY_BYTES}-byte file, "
            "mode 600)"
        )
    with os.fdopen(fd, "rb") as f:
        if st.st_mode & 0o077:
            raise NoiseKeyError(
                f"key file {path} is readable by group or others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}); whoever reads it can remove the noise. "
                f"Run: chmod 600 {path}"
            )
        key = f.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        size = max(st.st_size, len(key))  # what it holds, not what was read of it
        raise NoiseKeyError(f"key file {path} holds {size} bytes, not a {KEY_BYTES}-byte key")
    return key


def load_key(store: Store, key_file: str | None) -> bytes:
    """The key of an existing job: from `key_file` when given, else the store's secret.

    Raises:
        NoiseKeyError: the key is not there (the message says to pass --key-file), or
            the key file is refused (see `read_key_file`, `check_key_file_place`).
    """
    if key_file is not None:
        check_key_file_place(key_file, store.url)
        return read_key_file(key_file)
    key = store.get_secret(KEY_SECRET)
    if key is None:
        raise NoiseKeyError(
            f"{store.url} has no noise key (secret/{KEY_SECRET}); it was kept in a key "
            "file: pass --key-file / key_file="
        )
    if len(key) != KEY_BYTES:
        raise NoiseKeyError(
            f"{store.url}: secret/{KEY_SECRET} holds {len(key)} bytes, not a {KEY_BYTES}-byte "
            "key; the store's key is damaged"
        )
    return key


def create_key_file(path: str, key: bytes) -> None:
    """Write `key` to a new file `path`, 0600 (never overwrites: O_EXCL), fsynced.

    A write that fails (a full disk, a quota) removes the file it created: a partial
    key left behind would refuse every rerun until deleted by hand.

    Raises:
        OSError: the file exists, or creating, writing or syncing it failed (nothing
            is left at `path` then, unless it existed before).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        view = memoryview(key)
        while view:  # os.write may write less than asked
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)


def save_key(store: Store, key_file: str | None, key: bytes) -> None:
    """Keep a new job's key: in a new `key_file`, or as the store's secret.

    A key file that already exists is left as it is (it holds `key`: the caller read it).
    """
    if key_file is None:
        store.put_secret(KEY_SECRET, key)
    elif not os.path.exists(key_file):
        create_key_file(key_file, key)
