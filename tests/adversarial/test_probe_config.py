"""Issue 21 (adversarial probe), items 11 and 12: config values that were taken silently (a misspelt schedule key,
a compression ratio outside 0/4/128, a free-form index dtype) are refused, and a P/D descriptor needs its
signature and an integer schema version."""

from __future__ import annotations

import hashlib
import json

import pytest

from indexcache.plan import LayerPlan
from indexcache.plan.descriptor import Descriptor


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("index_topk_frequency", "index_topk_freq"),
        ("index_topk_patern", "index_topk_pattern"),
        ("index_skip_offset", "index_skip_topk_offset"),
        ("indexer_type", "indexer_types"),
        ("cli_factors", "cli_factor"),
        ("Index_Topk_Freq", "index_topk_freq"),
    ],
)
def test_item11_misspelt_schedule_key_is_refused(key, meant):
    """issue 21 item 11: a misspelt schedule key raises ValueError naming it and the key it resembles, instead
    of leaving every sparse layer a producer."""
    with pytest.raises(ValueError, match=rf"config key '{key}': .* did you mean '{meant}'\?"):
        LayerPlan.from_config({"num_hidden_layers": 8, key: 4 if "pattern" not in key else "FSSSFSSS"})


@pytest.mark.parametrize("ratio", [8, 64, 1, 3])
def test_item11_compress_ratio_outside_0_4_128_is_refused(ratio):
    """issue 21 item 11: a compress_ratios value other than 0, 4 or 128 raises ValueError naming the layer and
    the value, instead of being taken as a layer without an indexer."""
    with pytest.raises(ValueError, match=rf"compress_ratios\[3\]={ratio}: layer 3's compression ratio must be one"):
        LayerPlan.from_config({"num_hidden_layers": 5, "compress_ratios": [0, 4, 128, ratio, 4]})


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "float16", "torch.float8_e4m3fn", "anything"])
def test_item11_index_dtype_outside_the_accepted_names_is_refused(dtype):
    """issue 21 item 11: index_dtype goes into the P/D signature, so only the documented torch dtype names are
    accepted; anything else raises ValueError listing them."""
    with pytest.raises(ValueError, match=rf"index_dtype='{dtype}': must be one of 'float8_e4m3fn', 'float8_e4m3fnuz'"):
        LayerPlan.from_config({"num_hidden_layers": 4, "index_dtype": dtype})


def _payload(**changes) -> dict:
    """A descriptor payload with ``changes`` applied and its signature recomputed over the changed fields."""
    data = Descriptor.from_plan(LayerPlan(8, index_topk_freq=4)).to_dict()
    data.update(changes)
    signed = {key: value for key, value in data.items() if key not in ("producers", "signature")}
    canonical = json.dumps(signed, sort_keys=True, separators=(",", ":"))
    return {**data, "signature": hashlib.sha256(canonical.encode()).hexdigest()}


def test_item12_descriptor_without_signature_is_refused():
    """issue 21 item 12: a descriptor payload without a signature raises ValueError naming the missing key."""
    data = _payload()
    del data["signature"]
    with pytest.raises(ValueError, match=r"descriptor keys: missing \['signature'\]"):
        Descriptor.from_dict(data)


@pytest.mark.parametrize("version", [True, 1.0])
def test_item12_schema_version_must_be_an_int(version):
    """issue 21 item 12: schema_version true or 1.0 (even with a signature that matches them) raises ValueError;
    only the integer 1 is version 1."""
    with pytest.raises(ValueError, match=rf"schema_version={version!r}: must be the integer 1"):
        Descriptor.from_dict(_payload(schema_version=version))
