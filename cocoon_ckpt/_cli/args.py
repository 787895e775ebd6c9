"""Argument handling every command shares: the parser class with one-line errors, the
argument types (log level, seed), and the --storage-options and --json options."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

from cocoon_ckpt.errors import ConfigError

__all__ = [
    "LOG_LEVELS",
    "Parser",
    "add_json",
    "add_storage_options",
    "check_url",
    "log_level",
    "seed",
    "storage_options",
]

if TYPE_CHECKING:
    #: What `add_parser(sub)` of each command module receives (argparse names the class
    #: only privately, and it is generic only to type checkers).
    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2), like every other error of the CLI, and no
    abbreviated long options: argparse would silently take a prefix of a flag for the
    flag (`--target-epsilon` typed short), and a prefix that a later flag makes ambiguous
    would change meaning."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"cocoon-ckpt: error: {message}; see {self.prog} --help\n")


def log_level(value: str) -> str:
    """argparse type of --log-level: one of LOG_LEVELS, any case (a usage error otherwise)."""
    if value.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(LOG_LEVELS)}")
    return value.upper()


def seed(text: str) -> int:
    """argparse type of a seed: an integer >= 0 (a usage error otherwise, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; a seed is an integer >= 0")
    return value


def add_json(p: argparse.ArgumentParser, what: str) -> None:
    """--json: print `what` as one JSON document instead of text."""
    p.add_argument("--json", action="store_true", help=f"print the {what} as JSON")


def add_storage_options(p: argparse.ArgumentParser) -> None:
    """--storage-options JSON: fsspec options of the store URL (read by `storage_options`)."""
    p.add_argument(
        "--storage-options",
        default=None,
        metavar="JSON",
        help="fsspec options for the store URL as a JSON object, e.g. "
        '\'{"endpoint_url": "http://127.0.0.1:5000"}\' for an S3-compatible endpoint',
    )


def check_url(url: str, what: str) -> None:
    """Refuse a store URL whose scheme fsspec does not know (`s4://...`), naming the
    argument (`what`: `--store`, `URL`) and the schemes it knows, before anything opens
    it: fsspec's own "Protocol not known: s4" names neither.

    Raises:
        ConfigError: naming the argument, the scheme and fsspec's schemes.
    """
    import fsspec
    from fsspec.core import split_protocol

    known = set(fsspec.available_protocols())
    for part in url.split("::"):  # chained URLs: simplecache::s3://...
        scheme, _ = split_protocol(part)
        if scheme is not None and scheme not in known:
            raise ConfigError(
                f"{what} {url}: no storage knows the URL scheme {scheme!r}; use a local "
                f"path or a scheme fsspec knows: {', '.join(sorted(known))}"
            )


#: Types of the fsspec options users pass most (s3fs, gcsfs, adlfs): a string "false"
#: for `anon` would be truthy and silently change who the store is accessed as.
_OPTION_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("anon", "use_ssl", "skip_instance_cache", "use_listings_cache"), (bool,)),
    **dict.fromkeys(("requester_pays", "version_aware", "auto_mkdir"), (bool,)),
    **dict.fromkeys(("endpoint_url", "key", "secret", "token", "profile"), (str,)),
    **dict.fromkeys(("region_name", "account_name", "account_key", "project"), (str,)),
    **dict.fromkeys(("client_kwargs", "config_kwargs", "s3_additional_kwargs"), (dict,)),
}
_JSON_TYPE_NAMES = {bool: "boolean", str: "string", dict: "object"}


def storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """The parsed --storage-options, or None when not given.

    Raises:
        ConfigError: not JSON, not an object, or a well-known option of the wrong type.
    """
    if args.storage_options is None:
        return None
    try:
        opts = json.loads(args.storage_options)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"--storage-options is not valid JSON ({exc}); pass a JSON object"
        ) from None
    if not isinstance(opts, dict):
        raise ConfigError("--storage-options must be a JSON object, e.g. '{\"anon\": false}'")
    for k, v in opts.items():
        types = _OPTION_TYPES.get(k)
        if types is not None and not isinstance(v, types):
            raise ConfigError(
                f"--storage-options: {k}={json.dumps(v)} must be a JSON "
                f"{'/'.join(_JSON_TYPE_NAMES[t] for t in types)}"
            )
    return opts
