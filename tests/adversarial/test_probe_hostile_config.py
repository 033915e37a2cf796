"""Issue 34 (adversarial probe), items 2, 5 and 9: hostile model configs and P/D descriptors.

Every count a config or a descriptor carries is bounded by what a real model could have (indexcache.plan's
``MAX_*``), and every way the JSON can be hostile (nested past the parser, an integer past the interpreter's
digit limit, not UTF-8, too large, a wrong type in any field) is the library's one named error: ConfigError from
``LayerPlan.from_config``, DescriptorError from ``Descriptor.from_json``, and one line with exit status 2 from
``indexcache plan``. Every message is short, whatever the input holds.

The rows of FILES, DICTS and DESCRIPTORS leaked another exception, were accepted or printed megabytes on 29aceca;
the GUARD_* rows (the other wrong types, negative counts, bools for ints) held already and stay as guards, so the
tables cover every field and every kind.
"""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from indexcache.plan import (
    MAX_CONFIG_KEYS,
    MAX_INDEX_HEAD_DIM,
    MAX_INDEX_HEADS,
    MAX_LAYERS,
    MAX_MTP_LAYERS,
    MAX_PAGE_SIZE,
    MAX_TOPK,
    ConfigError,
    LayerPlan,
)
from indexcache.plan.descriptor import Descriptor, DescriptorError
from indexcache.plan.jsontext import MAX_JSON_BYTES
from indexcache.tools.cli import main

# An error message longer than this is a dump of the input, not a message.
LONGEST_MESSAGE = 600
# Every row is refused at once: no work proportional to what the hostile count asks for.
SECONDS = 5.0
DEEP = b"[" * 100_000 + b"]" * 100_000
DIGITS = b"9" * 5000  # past Python's default int/str digit limit (4300)
COUNT_KEYS = {  # the integer keys of a config, and the bound each is refused above
    "num_hidden_layers": MAX_LAYERS,
    "num_layers": MAX_LAYERS,
    "num_nextn_predict_layers": MAX_MTP_LAYERS,
    "index_topk_freq": MAX_LAYERS,
    "index_skip_topk_offset": MAX_LAYERS,
    "cli_factor": MAX_LAYERS,
    "index_topk": MAX_TOPK,
    "index_n_heads": MAX_INDEX_HEADS,
    "index_head_dim": MAX_INDEX_HEAD_DIM,
    "page_size": MAX_PAGE_SIZE,
}
WRONG_ITEMS = {"list": ["full"], "dict": {"full": 1}, "number": 1, "float": 1.0, "bool": True, "null": None}


def _config(**keys) -> bytes:
    """A config.json of 8 layers with ``keys`` (a layer count given in ``keys`` replaces num_hidden_layers)."""
    base = {} if {"num_hidden_layers", "num_layers"} & set(keys) else {"num_hidden_layers": 8}
    return json.dumps({**base, **keys}).encode()


# id: (config.json bytes, what the message says): each row leaked another exception, was accepted or printed
# megabytes on 29aceca.
FILES: dict[str, tuple[bytes, str]] = {
    "deep nesting in a key not read": (b'{"num_hidden_layers": 8, "x": ' + DEEP + b"}", "nested too deeply"),
    "deep nesting in indexer_types": (b'{"num_hidden_layers": 8, "indexer_types": ' + DEEP + b"}", "nested too deep"),
    "5000-digit layer count": (b'{"num_hidden_layers": ' + DIGITS + b"}", "integer literal of more than"),
    "5000-digit negative offset": (b'{"num_hidden_layers": 8, "index_skip_topk_offset": -' + DIGITS + b"}",
                                   "integer literal of more than"),
    "invalid UTF-8 in a value": (b'{"num_hidden_layers": 8, "name": "\xff\xfe"}', r"not UTF-8 text \(byte 0xff"),
    "invalid UTF-8 in a key": (b'{"num_hidden_layers": 8, "\xc3\x28": 1}', r"not UTF-8 text \(byte 0xc3"),
    "larger than MAX_JSON_BYTES": (_config(padding=" " * MAX_JSON_BYTES), f"more than {MAX_JSON_BYTES} bytes"),
    "too many keys": (_config(**{f"key_{i}": 0 for i in range(MAX_CONFIG_KEYS)}), "MAX_CONFIG_KEYS"),
    "a million-letter pattern": (_config(index_topk_pattern="F" * 10**6), "has 1000000 entries, not the layer count"),
    "a million indexer_types": (_config(indexer_types=["full"] * 10**6), "has 1000000 entries"),
    "a million compress_ratios": (_config(compress_ratios=[4] * 10**6), "has 1000000 entries"),
    "a million bools in indexer_types": (_config(indexer_types=[True] * 10**6), "indexer_types="),
    **{f"{kind} inside indexer_types": (_config(indexer_types=[item] + ["shared"] * 7), "position 0 is")
       for kind, item in {"list": ["full"], "dict": {"full": 1}}.items()},
    **{f"{key} just past its bound": (_config(**{key: bound + 1}), f"{key}={bound + 1}: must be at most {bound}")
       for key, bound in COUNT_KEYS.items()},
    **{f"{key} 2**40": (_config(**{key: 2**40}), f"{key}={2**40}: must be at most") for key in COUNT_KEYS},
}
# The other wrong types in every field, negative counts and bools for ints: these held on 29aceca already (a
# ConfigError) and are kept as guards, so that the tables cover every field and every kind.
GUARD_FILES: dict[str, tuple[bytes, str]] = {
    "a list, not an object": (b"[8]", "config must be a JSON object"),
    **{f"{kind} inside indexer_types": (_config(indexer_types=[item] + ["shared"] * 7), "position 0 is")
       for kind, item in WRONG_ITEMS.items() if kind not in ("list", "dict")},
    **{f"{kind} inside compress_ratios": (_config(compress_ratios=[item] + [4] * 7), r"compress_ratios\[0\]=")
       for kind, item in WRONG_ITEMS.items()},
    **{f"{kind} as index_topk_pattern": (_config(index_topk_pattern=item), "index_topk_pattern=")
       for kind, item in {"list": ["F"] * 8, "dict": {"F": 1}, "number": 1}.items()},
    **{f"{kind} as index_dtype": (_config(index_dtype=item), "index_dtype=") for kind, item in WRONG_ITEMS.items()
       if item is not None},
    **{f"{key} negative": (_config(**{key: -1}), f"{key}=-1: must be an integer >= ") for key in COUNT_KEYS},
    **{f"{key} a bool": (_config(**{key: True}), f"{key}=True: must be an integer >= ") for key in COUNT_KEYS},
    **{f"{key} a list": (_config(**{key: [8]}), rf"{key}=\[8\]: must be an integer >= ") for key in COUNT_KEYS},
}


def _deep_list(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


# id: (config dict, what the message says): what only a Python caller can pass.
DICTS: dict[str, tuple[dict, str]] = {
    "a 20000-bit layer count": ({"num_hidden_layers": 2**20000}, "an integer of about 6021 digits"),
    "a negative 20000-bit layer count": ({"num_hidden_layers": -(2**20000)}, "a negative integer of about"),
    "a 20000-bit top-k": ({"num_hidden_layers": 8, "index_topk": 2**20000}, "index_topk=<an integer of"),
    "a layer count nested 100000 deep": ({"num_hidden_layers": _deep_list(100_000)}, r"num_hidden_layers=\[\[\["),
    "indexer_types nested 100000 deep": ({"num_hidden_layers": 2, "indexer_types": [_deep_list(100_000), "shared"]},
                                         "position 0 is"),
    "indexer_types of 10**12 entries": ({"num_hidden_layers": 8, "indexer_types": range(10**12)}, "has 1000000000000"),
    "compress_ratios of 10**12 entries": ({"num_hidden_layers": 8, "compress_ratios": range(10**12)}, "1000000000000"),
    "a huge string index_dtype": ({"num_hidden_layers": 8, "index_dtype": "f" * 10**7}, "index_dtype='fff"),
    "a 20000-bit index_dtype": ({"num_hidden_layers": 8, "index_dtype": 2**20000}, "index_dtype=<an integer"),
}


def _timed(call):
    start = time.perf_counter()
    try:
        call()
    finally:
        elapsed = time.perf_counter() - start
        assert elapsed < SECONDS, f"took {elapsed:.1f} s"


def _check_message(exc: pytest.ExceptionInfo, message: str) -> None:
    text = str(exc.value)
    assert len(text) < LONGEST_MESSAGE and "\n" not in text, text[:2000]
    assert exc.match(message)


def _from_file(tmp_path, content: bytes, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as exc:
        _timed(lambda: LayerPlan.from_config(path))
    _check_message(exc, message)


@pytest.mark.parametrize(("content", "message"), FILES.values(), ids=FILES.keys())
def test_from_config_file_refuses_hostile_json_with_config_error(tmp_path, content, message):
    """items 2, 5, 9: a hostile config.json raises ConfigError at once, with a short message (naming the file
    when the text itself is at fault); 29aceca raised RecursionError, ValueError, UnicodeDecodeError, TypeError,
    MemoryError, accepted it, or put the whole list in the message."""
    _from_file(tmp_path, content, message)


@pytest.mark.parametrize(("content", "message"), GUARD_FILES.values(), ids=GUARD_FILES.keys())
def test_from_config_file_refuses_wrong_types_with_config_error(tmp_path, content, message):
    """items 2, 5 (guards, held on 29aceca): every other wrong type, negative count and bool is a ConfigError."""
    _from_file(tmp_path, content, message)


@pytest.mark.parametrize(("config", "message"), DICTS.values(), ids=DICTS.keys())
def test_from_config_dict_refuses_hostile_values_with_config_error(config, message):
    """items 2, 5: values only a Python caller can pass (ints past the digit limit, nesting past the recursion
    limit, a sequence of 10^12 entries) raise ConfigError with a short message."""
    with pytest.raises(ConfigError) as exc:
        _timed(lambda: LayerPlan.from_config(config))
    _check_message(exc, message)


def test_the_bounds_themselves_are_accepted():
    """item 2: each bound is inclusive: a config at every bound at once is a plan."""
    plan = LayerPlan.from_config({"num_hidden_layers": MAX_LAYERS, "num_nextn_predict_layers": MAX_MTP_LAYERS,
                                  "index_topk_freq": MAX_LAYERS, "index_skip_topk_offset": MAX_LAYERS,
                                  "index_topk": MAX_TOPK, "index_n_heads": MAX_INDEX_HEADS,
                                  "index_head_dim": MAX_INDEX_HEAD_DIM, "page_size": MAX_PAGE_SIZE})
    assert plan.num_layers == MAX_LAYERS + MAX_MTP_LAYERS
    assert Descriptor.from_json(Descriptor.from_plan(plan).to_json()) == Descriptor.from_plan(plan)


def test_plan_top_k_bound_is_the_ops_bound():
    """item 2: the plan (pure Python) repeats the ops' MAX_TOPK; they must agree."""
    from indexcache.hal.checks import MAX_TOPK as OPS_MAX_TOPK

    assert MAX_TOPK == OPS_MAX_TOPK


def test_stage_boundaries_are_read_no_further_than_the_layers():
    """item 2: split_stages takes at most num_layers - 1 boundaries; a longer iterable (a million here, or an
    endless one) is refused after reading num_layers of them, not read to its end."""
    plan = LayerPlan(8)
    read = []

    def boundaries():
        for boundary in range(1, 10**6):
            read.append(boundary)
            yield boundary

    with pytest.raises(ConfigError, match=r"must be strictly increasing layer ids in 1\.\.7"):
        _timed(lambda: plan.split_stages(boundaries()))
    assert len(read) == plan.num_layers


@pytest.mark.parametrize(("content", "message"), (*FILES.values(), *GUARD_FILES.values()),
                         ids=(*FILES, *(f"guard: {key}" for key in GUARD_FILES)))
def test_plan_cli_prints_one_line_and_exits_2(tmp_path, capsys, content, message):
    """items 5, 9: `indexcache plan --config` on a hostile file exits 2 with one short line on stderr and no
    traceback; on 29aceca the rows of FILES raised through main (a traceback from the console script) or were
    accepted, the guards held."""
    path = tmp_path / "config.json"
    path.write_bytes(content)
    code = None

    def run():
        nonlocal code
        code = main(["plan", "--config", str(path)])

    _timed(run)
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith("indexcache plan: error: ") and err.count("\n") == 1, err[:2000]
    assert len(err) < LONGEST_MESSAGE + 100 and "Traceback" not in err


# --- P/D descriptors -----------------------------------------------------------------------------------


def _payload(**changes) -> dict:
    """A descriptor payload with ``changes`` and a signature that matches them (so only the field checks refuse)."""
    data = Descriptor.from_plan(LayerPlan(8, index_topk_freq=4)).to_dict()
    data.update(changes)
    signed = {key: value for key, value in data.items() if key not in ("producers", "signature")}
    canonical = json.dumps(signed, sort_keys=True, separators=(",", ":"))
    return {**data, "signature": hashlib.sha256(canonical.encode()).hexdigest()}


def _text(**changes) -> str:
    return json.dumps(_payload(**changes))


DESCRIPTOR_COUNTS = {"num_layers": MAX_LAYERS + MAX_MTP_LAYERS, "top_k": MAX_TOPK, "index_n_heads": MAX_INDEX_HEADS,
                     "index_head_dim": MAX_INDEX_HEAD_DIM, "page_size": MAX_PAGE_SIZE}
# id: (what from_json is given, what the message says): each row leaked another exception, was accepted or
# printed hundreds of KB on 29aceca.
DESCRIPTORS: dict[str, tuple[object, str]] = {
    "deep nesting": (DEEP.decode(), "descriptor: JSON nested too deeply"),
    "deep nesting in sparse_layers": (_text().replace('"sparse_layers": [', '"sparse_layers": [' + "[" * 10**5, 1)
                                      + "]" * 10**5, "nested too deeply"),
    "5000-digit top_k": (_text().replace('"top_k": 2048', '"top_k": ' + DIGITS.decode()), "integer literal of more"),
    "5000-digit layer id": (_text().replace('"producers": [0', '"producers": [' + DIGITS.decode()),
                            "integer literal of more"),
    "invalid UTF-8 bytes": (b'{"index_dtype": "\xff"}', r"descriptor: not UTF-8 text \(byte 0xff at offset 17\)"),
    "larger than MAX_JSON_BYTES": (_text() + " " * MAX_JSON_BYTES, f"more than {MAX_JSON_BYTES} characters"),
    "larger than MAX_JSON_BYTES, as bytes": ((_text() + " " * MAX_JSON_BYTES).encode(), f"more than {MAX_JSON_BYTES}"),
    "None": (None, "expected JSON text"),
    "a number": (5, "expected JSON text"),
    "a list of texts": ([_text()], "expected JSON text"),
    "sparse_layers longer than num_layers": (_text(num_layers=8, sparse_layers=list(range(10**5))),
                                             r"sparse_layers=\(0, 1, 2, .*at most num_layers \(8\)"),
    **{f"{field} just past its bound": (_text(**{field: bound + 1}), f"{field}={bound + 1}: must be at most {bound}")
       for field, bound in DESCRIPTOR_COUNTS.items()},
    **{f"{field} 2**40": (_text(**{field: 2**40}), f"{field}={2**40}: must be at most") for field in DESCRIPTOR_COUNTS},
}
# Guards (held on 29aceca): wrong types in every field, negative counts, bools for ints.
GUARD_DESCRIPTORS: dict[str, tuple[object, str]] = {
    **{f"{kind} inside {field}": (_text(**{field: [item]}), f"{field}=")
       for field in ("sparse_layers", "producers") for kind, item in {**WRONG_ITEMS, "number": "0"}.items()},
    **{f"{kind} as {field}": (_text(**{field: item}), f"{field}=")
       for field in ("sparse_layers", "producers") for kind, item in {"dict": {"0": 0}, "string": "0..7",
                                                                      "null": None, "number": 0}.items()},
    **{f"{field} negative": (_text(**{field: -1}), f"{field}=-1: must be an integer >= 1")
       for field in DESCRIPTOR_COUNTS},
    **{f"{field} a bool": (_text(**{field: True}), f"{field}=True: must be an integer >= 1")
       for field in DESCRIPTOR_COUNTS},
    **{f"{field} a list": (_text(**{field: [8]}), rf"{field}=\(8,\): must be an integer >= 1")
       for field in DESCRIPTOR_COUNTS},
}


def _from_json(given: object, message: str) -> None:
    with pytest.raises(DescriptorError) as exc:
        _timed(lambda: Descriptor.from_json(given))
    _check_message(exc, message)


@pytest.mark.parametrize(("given", "message"), DESCRIPTORS.values(), ids=DESCRIPTORS.keys())
def test_descriptor_from_json_refuses_hostile_text_with_descriptor_error(given, message):
    """items 2, 5: a hostile descriptor payload raises DescriptorError at once with a short message; 29aceca raised
    RecursionError, ValueError, UnicodeDecodeError, TypeError, accepted 2^40 layers or printed 600 KB."""
    _from_json(given, message)


@pytest.mark.parametrize(("given", "message"), GUARD_DESCRIPTORS.values(), ids=GUARD_DESCRIPTORS.keys())
def test_descriptor_from_json_refuses_wrong_types_with_descriptor_error(given, message):
    """items 2, 5 (guards, held on 29aceca): every other wrong type, negative count and bool is a DescriptorError."""
    _from_json(given, message)


def test_descriptor_from_dict_with_keys_of_any_type():
    """item 5: a Python payload with keys that do not sort together (an int beside the strings) is a
    DescriptorError naming them, not a TypeError from sorting."""
    with pytest.raises(DescriptorError, match=r"unknown \[1, 'freq'\]"):
        Descriptor.from_dict({**_payload(), 1: 2, "freq": 4})
