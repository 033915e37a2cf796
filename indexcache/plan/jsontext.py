"""Untrusted JSON in, named errors out: the one place a model config or a P/D descriptor is read from text.

:func:`read_json` and :func:`parse_json` turn every way a file or a text can be malformed (too large, not UTF-8,
not JSON, nested deeper than the parser can follow, an integer literal past the interpreter's digit limit, a key
given twice in one object)
into the caller's error class, naming the file; :func:`shown` writes a value of any size, depth or type into a
message in bounded space and time.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
import sys
from typing import Any

# A config.json is a few KB (a quantization config's module lists make it some hundreds); a descriptor of the
# deepest plan (4096 + 64 layers) is about 50 KB. Text beyond this is refused before it is parsed.
MAX_JSON_BYTES = 16 * 2**20


def read_json(path: str | os.PathLike[str], error: type[Exception]) -> Any:
    """The JSON value of the file at ``path``; a file that cannot be opened raises ``OSError``, one that is too
    large or not UTF-8 JSON raises ``error`` naming ``path``."""
    with open(path, "rb") as f:
        data = f.read(MAX_JSON_BYTES + 1)  # a device or a huge file stops here
    return parse_json(data, os.fspath(path), error)


def parse_json(text: str | bytes, what: str, error: type[Exception]) -> Any:
    """The JSON value of ``text`` (str, or UTF-8 bytes); anything else raises ``error`` starting with ``what``."""
    if isinstance(text, (bytes, bytearray)):
        if len(text) > MAX_JSON_BYTES:
            raise error(f"{what}: more than {MAX_JSON_BYTES} bytes (indexcache.plan.jsontext.MAX_JSON_BYTES)")
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"{what}: not UTF-8 text (byte {text[exc.start]:#04x} at offset {exc.start})") from None
    elif not isinstance(text, str):
        raise error(f"{what}: expected JSON text (str or UTF-8 bytes), got {type(text).__name__}")
    elif len(text) > MAX_JSON_BYTES:
        raise error(f"{what}: more than {MAX_JSON_BYTES} characters (indexcache.plan.jsontext.MAX_JSON_BYTES)")
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise error(f"{what}: key {shown(exc.args[0])} appears twice in one object; which one holds is "
                    "ambiguous (JSON readers differ): keep one") from None
    except RecursionError:
        raise error(f"{what}: JSON nested too deeply to read (past Python's recursion limit, "
                    f"{sys.getrecursionlimit()})") from None
    except json.JSONDecodeError as exc:
        raise error(f"{what}: not valid JSON: {exc}") from None
    except ValueError:  # the only other: an integer literal beyond sys.get_int_max_str_digits()
        raise error(f"{what}: an integer literal of more than {sys.get_int_max_str_digits()} digits; "
                    "no value indexcache reads is that large") from None


class _DuplicateKey(ValueError):
    """A key given twice in one JSON object (``json`` keeps the last silently)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _DuplicateKey(key)
        found[key] = value
    return found


class _Bounded(reprlib.Repr):
    """``repr`` cut short: a few levels, entries and characters, and huge integers by their size."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = self.maxdeque = self.maxarray = 12
        self.maxdict = 8
        self.maxstring = self.maxother = 80
        self.maxlong = 60

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 192:  # repr would take time, or fail past the interpreter's digit limit
            digits = math.floor(x.bit_length() * math.log10(2)) + 1
            return f"<{'a negative' if x < 0 else 'an'} integer of about {digits} digits>"
        return repr(x)


_BOUNDED = _Bounded()


def shown(value: Any) -> str:
    """``repr(value)`` for a message, at most a few hundred characters whatever ``value`` holds."""
    return _BOUNDED.repr(value)
