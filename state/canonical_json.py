"""A manifest's canonical text: the bytes of `json.dumps(doc, sort_keys=True, indent=1)`,
made faster.

With an indent, `json.dumps` runs json's pure-Python encoder, one generator step per
value. A manifest at 1,500 steps holds ~4,500 metric values, and both the writer (at each
commit) and every reader (which re-serialises to check the stored bytes are canonical)
paid ~11 ms CPU per manifest for it. Here a list of numbers, booleans and nulls (no
strings, so no ", " inside an item) goes through the C encoder in one call and is split
into its items; everything else is emitted the way the pure-Python encoder does. The
result is the same text, character for character (tests/state/test_canonical_json.py
compares it with `json.dumps` over generated documents and a real manifest). Measured on
a 1,500-step manifest (built as that test builds one), 6 alternating rounds at
load 2-3: the serialisation alone 11.7 -> 6.2 ms; `Manifest.to_bytes` 16.6 -> 13.4 ms
median and `from_bytes` 23 -> 19 ms. What is left is the floats' repr and parse, done
once per pass (round trip, record checksums, this text): the curve as arrays would
remove it (a format change, not made here). Scalars are written without `json.dumps`
(its call costs more than the text: ~300 of them a small manifest), the same text.

Bounds. JSON has no non-finite numbers, so `canonical_text` refuses NaN and infinities
(and nesting deeper than `MAX_DEPTH`), naming where in the document they lie: a manifest
stays valid JSON that every reader parses. `load_bounded` is how a record read from a
store is parsed: nesting deeper than `MAX_DEPTH`, a number token longer than
`MAX_NUMBER_CHARS` characters and NaN/Infinity are refused by a scan of the text before
`json.loads` sees it (`json.loads` alone raises RecursionError on a deep document, and
ValueError past Python's 4,300-digit integer limit, neither naming the record).
"""

from __future__ import annotations

import json
import re
from json.encoder import encode_basestring_ascii as _quote
from typing import Any

__all__ = [
    "MAX_DEPTH",
    "MAX_NUMBER_CHARS",
    "JSONBoundsError",
    "NonFiniteError",
    "canonical_text",
    "load_bounded",
]

#: The deepest nesting of arrays and objects a record may have, written or read. A
#: manifest's own structure is 4 deep; a part's state record (`{"dict": [[k, v]]}`)
#: takes 3 levels per level of the part's state, which `format.part_state` bounds to 32.
MAX_DEPTH = 128
#: The longest number token a record read from a store may hold, in characters: a
#: float's repr is at most 24, a 256-bit integer 78.
MAX_NUMBER_CHARS = 100

_JSON_SEP = ", "  # the C encoder's item separator without an indent


class JSONBoundsError(json.JSONDecodeError):
    """A document refused before it was parsed: nested deeper than `MAX_DEPTH`, a number
    longer than `MAX_NUMBER_CHARS` or past a float's range, or NaN/Infinity (a
    `json.JSONDecodeError`, so callers that report a torn document by its position
    report this one alike)."""


class NonFiniteError(ValueError):
    """`canonical_text` was handed a value JSON cannot hold (NaN, an infinity) or nesting
    deeper than `MAX_DEPTH`.

    Attributes:
        where: the value's place in the document, `/`-separated keys and indices
            (`records/stateful/ema/state`).
    """

    def __init__(self, what: str, where: list[str]) -> None:
        self.what = what
        self.where = where
        super().__init__(what)

    def __str__(self) -> str:
        where = list(reversed(self.where))
        if len(where) > 8:
            where = [*where[:4], "...", *where[-2:]]
        return f"{'/'.join(where) or 'the document'} {self.what}; it is not written"


# The scan before parsing, on bytes (C speed throughout; the token by token scan that
# names the place runs only on a document found beyond the bounds): strings, escapes
# included (an unterminated one to the end), are set aside first, so brackets, digits
# and words inside them count for nothing; then every character a number token may
# hold becomes `#` and a run of more than MAX_NUMBER_CHARS of them is looked for. A
# float past 1.8e308 parses to inf: a positive exponent of 3 digits is looked at.
_STRING_B = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?')
_NUMBER_CHARS = b"0123456789+-.eE"
_MARK = bytes.maketrans(_NUMBER_CHARS, b"#" * len(_NUMBER_CHARS))
_LONG = b"#" * (MAX_NUMBER_CHARS + 1)
_BIG_EXPONENT = re.compile(rb"[eE]\+?0*[1-9][0-9]{2}")
_BRACKETS = re.compile(rb"[^\[\]{}]+")
_TOKEN = re.compile(
    r'(?P<s>"[^"\\]*(?:\\.[^"\\]*)*"?)|(?P<open>[\[{])|(?P<close>[\]}])'
    rf"|(?P<bad>[-+0-9.eE]{{{MAX_NUMBER_CHARS + 1},}}|NaN|Infinity)|(?P<num>[-+0-9.eE]+)"
)


def load_bounded(data: bytes | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads(data)`, once a scan has found the text within bounds.

    Args:
        data: the document (bytes in any encoding `json.loads` detects).
        max_depth: the deepest nesting of arrays and objects allowed.

    Raises:
        JSONBoundsError: nested deeper than `max_depth`, a number token longer than
            `MAX_NUMBER_CHARS`, a float beyond a float's range, or NaN/Infinity; `pos`
            is where (a `JSONDecodeError`).
        json.JSONDecodeError: not JSON.
        UnicodeDecodeError: bytes of no encoding JSON allows.
    """
    if isinstance(data, str):
        text, raw = data, data.encode("utf-8", "surrogatepass")
    else:
        encoding = json.detect_encoding(data)
        text = data.decode(encoding)
        raw = data if encoding == "utf-8" else text.encode("utf-8", "surrogatepass")
    outside = _STRING_B.sub(b'""', raw)
    beyond = (
        _LONG in outside.translate(_MARK)
        or b"NaN" in outside
        or b"Infinity" in outside
        or _BIG_EXPONENT.search(outside) is not None
    )
    if not beyond and outside.count(b"[") + outside.count(b"{") > max_depth:
        depth = 0
        for c in _BRACKETS.sub(b"", outside):
            depth += 1 if c in b"[{" else -1
            if depth > max_depth:
                beyond = True
                break
    if beyond:
        _refuse(text, max_depth)
    return json.loads(text, parse_constant=_constant)


def _refuse(text: str, max_depth: int) -> None:
    """Raise the `JSONBoundsError` of the first place in `text` beyond the bounds, if any."""
    depth = 0
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup
        if kind == "open":
            depth += 1
            if depth > max_depth:
                raise JSONBoundsError(f"nested deeper than {max_depth} levels", text, m.start())
        elif kind == "close":
            depth -= 1
        elif kind == "num":
            if not _finite(m.group()):
                raise JSONBoundsError(f"holds {m.group()}, beyond a float's range", text, m.start())
        elif kind == "bad":
            token = m.group()
            what = (
                f"holds {token}, which JSON does not allow"
                if token in ("NaN", "Infinity")
                else f"holds a number of {len(token)} characters (at most {MAX_NUMBER_CHARS})"
            )
            raise JSONBoundsError(what, text, m.start())
    # within bounds: the quick scan saw only a large exponent of a finite float


def _finite(token: str) -> bool:
    try:
        value = float(token)
    except ValueError:
        return True  # not a number: json.loads names it
    return value - value == 0


def _constant(name: str) -> Any:
    raise JSONBoundsError(f"holds {name}, which JSON does not allow", name, 0)


def _flat(items: list[Any]) -> bool:
    """Whether every item is a number, a boolean or null (its JSON has no ", ")."""
    return all(type(x) in (int, float, bool) or x is None for x in items)


def _emit(value: Any, level: int, out: list[str]) -> None:
    kind = type(value)
    if kind is dict or kind is list:
        if level >= MAX_DEPTH:
            raise NonFiniteError(
                f"nests deeper than {MAX_DEPTH} levels of arrays and objects (flatten it, "
                "or store it as an array)",
                [],
            )
        place: list[Any] = []  # the key or index being written, to name a refused value
        try:
            (_emit_dict if kind is dict else _emit_list)(value, level, out, place)
        except NonFiniteError as exc:
            exc.where.extend(str(p) for p in place[-1:])
            raise
    elif kind is str:
        out.append(_quote(value))  # what json.dumps does for a str (ensure_ascii)
    elif value is None:
        out.append("null")
    elif kind is bool:
        out.append("true" if value else "false")
    elif kind is int:
        out.append(int.__repr__(value))
    elif kind is float:
        out.append(_float(value))
    else:  # tuples, subclasses, other keys: leave them to json itself
        out.append(_indented(value, level))


def _emit_dict(value: dict[Any, Any], level: int, out: list[str], place: list[Any]) -> None:
    if not value:
        out.append("{}")
        return
    if any(type(k) is not str for k in value):  # json converts and sorts such keys
        out.append(_indented(value, level))
        return
    pad = "\n" + " " * (level + 1)
    out.append("{")
    place.append(None)
    for i, key in enumerate(sorted(value)):
        place[0] = key
        out.append(pad if i == 0 else "," + pad)
        out.append(_quote(key))
        out.append(": ")
        _emit(value[key], level + 1, out)
    out.append("\n" + " " * level + "}")


def _emit_list(value: list[Any], level: int, out: list[str], place: list[Any]) -> None:
    if not value:
        out.append("[]")
        return
    pad = "\n" + " " * (level + 1)
    place.append(None)
    if _flat(value):
        try:
            text = json.dumps(value, allow_nan=False)
        except ValueError:  # NaN or an infinity: name the first
            place[0] = next(i for i, x in enumerate(value) if type(x) is float and x - x != 0)
            _float(value[place[0]])
            raise
        items = text[1:-1].split(_JSON_SEP)
        out.append("[" + pad + ("," + pad).join(items) + "\n" + " " * level + "]")
        return
    out.append("[")
    for i, item in enumerate(value):
        place[0] = i
        out.append(pad if i == 0 else "," + pad)
        _emit(item, level + 1, out)
    out.append("\n" + " " * level + "]")


def _float(value: float) -> str:
    """A float as json's encoder writes it (`float.__repr__`); NaN and the infinities,
    which JSON does not have, are refused."""
    if value - value != 0:  # NaN, inf, -inf
        raise NonFiniteError(
            f"is {value!r}, which JSON does not have (store such a value as an array, or as text)",
            [],
        )
    return float.__repr__(value)


def _indented(value: Any, level: int) -> str:
    try:
        text = json.dumps(value, sort_keys=True, indent=1, allow_nan=False)
    except ValueError as exc:
        raise NonFiniteError(
            f"holds a value JSON does not have ({exc}; store such a value as an array, or as text)",
            [],
        ) from None
    return text.replace("\n", "\n" + " " * level) if level else text


def canonical_text(doc: dict[str, Any]) -> str:
    """`json.dumps(doc, sort_keys=True, indent=1)`, the same text.

    Args:
        doc: a JSON document as `json.loads` returns it (dicts with string keys, lists,
            str, int, float, bool, None); other types fall back to `json.dumps`.

    Raises:
        NonFiniteError: `doc` holds NaN or an infinity, or nests deeper than
            `MAX_DEPTH`; the message names where.
    """
    out: list[str] = []
    _emit(doc, 0, out)
    return "".join(out)
