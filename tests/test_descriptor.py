"""The P/D descriptor: signature stability, compatibility, JSON round trip, prefill-rank agreement."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexcache.plan import LayerPlan
from indexcache.plan.descriptor import (
    SCHEMA_VERSION,
    Descriptor,
    DescriptorError,
    PDIncompatibleError,
    check_pd_compatible,
    check_ranks_agree,
)

V4_EXAMPLE_RATIOS = [0, 0, 4, 128, 4, 128, 4, 128, 4, 0]


def v32(**kwargs) -> Descriptor:
    return Descriptor.from_plan(LayerPlan(61, **kwargs))


def test_from_plan_takes_layout_and_producers():
    plan = LayerPlan(10, compress_ratios=V4_EXAMPLE_RATIOS, index_topk_freq=4, index_topk=512, page_size=1)
    d = Descriptor.from_plan(plan)
    assert d.num_layers == 10 and d.sparse_layers == (2, 4, 6, 8) and d.producers == (2,)
    assert (d.top_k, d.index_n_heads, d.index_head_dim, d.page_size) == (512, 64, 128, 1)
    assert d.index_dtype == "float8_e4m3fn" and d.schema_version == SCHEMA_VERSION


def test_signature_is_pinned():
    # The canonical form is a wire format: changing it must be deliberate (bump SCHEMA_VERSION).
    assert (
        v32(index_topk_freq=4).signature == "e3e13c33ca0ffe5967e33e585fcd7c0159fdcbc3000981259885634aee0d01ad"
    )


def test_signature_ignores_the_schedule():
    signatures = {
        v32().signature,
        v32(index_topk_freq=4).signature,
        v32(index_topk_freq=4, index_skip_topk_offset=3).signature,
        v32(cli_factor=2).signature,
        v32(index_topk_pattern="F" + "S" * 60).signature,
        v32(indexer_types=["full"] + ["shared"] * 60).signature,
    }
    assert len(signatures) == 1


@pytest.mark.parametrize(
    "change",
    [
        {"num_hidden_layers": 62},
        {"num_nextn_predict_layers": 1},
        {"compress_ratios": [4] * 60 + [0]},
        {"index_topk": 512},
        {"index_n_heads": 32},
        {"index_head_dim": 64},
        {"index_dtype": "float8_e4m3fnuz"},
        {"page_size": 1},
    ],
)
def test_signature_covers_every_layout_field(change):
    kwargs = {"num_hidden_layers": 61, **change}
    assert Descriptor.from_plan(LayerPlan(**kwargs)).signature != v32().signature


def test_prefill_freq1_serves_decode_freq4():
    check_pd_compatible(v32(), v32(index_topk_freq=4))
    check_pd_compatible(v32(index_topk_freq=4), v32(index_topk_freq=4))


def test_decode_freq1_is_not_served_by_prefill_freq4():
    with pytest.raises(
        PDIncompatibleError, match=r"decode producers \[2, 3, 4, 6,.*\] are not prefill producers"
    ) as err:
        check_pd_compatible(v32(index_topk_freq=4), v32())
    assert isinstance(err.value, ValueError)
    assert err.value.differences == {}
    assert err.value.uncovered[:3] == (2, 3, 4) and 5 not in err.value.uncovered


def test_decode_producers_must_be_a_subset_not_just_fewer():
    with pytest.raises(PDIncompatibleError, match=r"decode producers \[2\] are not prefill producers") as err:
        check_pd_compatible(v32(index_topk_freq=4), v32(index_topk_pattern="FFF" + "S" * 58))
    assert err.value.uncovered == (2,)


def test_a_promoting_pipeline_split_is_described_by_the_plan_its_stages_run():
    # Decode over 4 stages promotes layers 15 and 30; a prefill without the split never computed their index keys.
    plan = LayerPlan(61, index_topk_freq=4)
    stages = plan.split_stages([15, 30, 45], mode="promote")
    decode = Descriptor.from_plan(functools.reduce(LayerPlan.for_stage, stages, plan))
    assert decode.producers == tuple(sorted({*plan.producers, 15, 30}))
    assert check_ranks_agree([decode] * len(stages)) == decode
    with pytest.raises(PDIncompatibleError, match=r"decode producers \[15, 30\] are not prefill producers") as err:
        check_pd_compatible(Descriptor.from_plan(plan), decode)
    assert err.value.uncovered == (15, 30)
    check_pd_compatible(decode, Descriptor.from_plan(plan))  # the promoting prefill serves a decode without it

def test_every_differing_field_is_named():
    prefill = v32(index_topk_freq=4)
    decode = Descriptor.from_plan(
        LayerPlan(62, index_topk=512, index_n_heads=32, index_head_dim=64, index_dtype="bfloat16", page_size=1)
    )
    with pytest.raises(PDIncompatibleError) as err:
        check_pd_compatible(prefill, decode)
    message = str(err.value)
    assert "num_layers differs (prefill 61, decode 62)" in message
    assert "sparse_layers differs (only prefill: [], only decode: [61])" in message
    assert "top_k differs (prefill 2048, decode 512)" in message
    assert "index_n_heads differs (prefill 64, decode 32)" in message
    assert "index_head_dim differs (prefill 128, decode 64)" in message
    assert "index_dtype differs (prefill 'float8_e4m3fn', decode 'bfloat16')" in message
    assert "page_size differs (prefill 64, decode 1)" in message
    assert "decode producers [2, 3, 4" in message
    assert set(err.value.differences) == {
        "num_layers",
        "sparse_layers",
        "top_k",
        "index_n_heads",
        "index_head_dim",
        "index_dtype",
        "page_size",
    }
    assert err.value.differences["top_k"] == (2048, 512)


def test_sparse_layer_difference_alone():
    prefill = Descriptor.from_plan(LayerPlan(10, compress_ratios=V4_EXAMPLE_RATIOS))
    decode = Descriptor.from_plan(LayerPlan(10, compress_ratios=[0, 4, 4, 128, 4, 128, 4, 128, 0, 0]))
    with pytest.raises(
        PDIncompatibleError, match=r"sparse_layers differs \(only prefill: \[8\], only decode: \[1\]\)"
    ):
        check_pd_compatible(prefill, decode)


# --- JSON ---------------------------------------------------------------------------------------


def test_to_dict_holds_fields_producers_and_signature():
    d = v32(index_topk_freq=4)
    data = json.loads(d.to_json())
    assert data["signature"] == d.signature
    assert data["producers"] == [0, 1, *range(5, 58, 4)]
    assert data["sparse_layers"] == list(range(61))
    assert set(data) == {f.name for f in dataclasses.fields(Descriptor)} | {"signature"}


@st.composite
def descriptors(draw) -> Descriptor:
    layers = draw(st.integers(1, 30))
    ratios = draw(st.none() | st.lists(st.sampled_from([0, 4, 128]), min_size=layers, max_size=layers))
    plan = LayerPlan(
        layers,
        compress_ratios=ratios,
        index_topk_freq=draw(st.integers(1, 6)),
        num_nextn_predict_layers=draw(st.integers(0, 2)),
        index_topk=draw(st.integers(1, 4096)),
        index_n_heads=draw(st.sampled_from([16, 32, 64])),
        index_head_dim=draw(st.sampled_from([64, 128])),
        index_dtype=draw(st.sampled_from(["float8_e4m3fn", "float8_e4m3fnuz", "bfloat16"])),
        page_size=draw(st.integers(1, 256)),
    )
    return Descriptor.from_plan(plan)


@settings(max_examples=50, deadline=None)
@given(descriptors())
def test_json_round_trip(descriptor):
    text = descriptor.to_json()
    back = Descriptor.from_json(text)
    assert back == descriptor
    assert back.signature == descriptor.signature
    assert back.to_json() == text
    assert Descriptor.from_dict(descriptor.to_dict()) == descriptor


def test_tampered_signature_is_refused():
    data = v32().to_dict()
    data["top_k"] = 512
    with pytest.raises(ValueError, match=r"signature='[0-9a-f]{64}': does not match the descriptor's fields"):
        Descriptor.from_dict(data)


def test_payload_without_signature_is_refused():
    data = v32().to_dict()
    del data["signature"]
    with pytest.raises(ValueError, match=r"descriptor keys: missing \['signature'\], unknown \[\]"):
        Descriptor.from_dict(data)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("page_size"), r"descriptor keys: missing \['page_size'\], unknown \[\]"),
        (lambda d: d.update(freq=4), r"descriptor keys: missing \[\], unknown \['freq'\]"),
        (lambda d: d.update(schema_version=2), r"schema_version=2: must be the integer 1, the version this"),
        (lambda d: d.update(schema_version=True), r"schema_version=True: must be the integer 1"),
        (lambda d: d.update(schema_version=1.0), r"schema_version=1\.0: must be the integer 1"),
        (lambda d: d.update(top_k=0), r"top_k=0: must be an integer >= 1"),
        (lambda d: d.update(page_size="64"), r"page_size='64': must be an integer >= 1"),
        (lambda d: d.update(index_dtype=""), r"index_dtype='': must be one of 'float8_e4m3fn', "),
        (lambda d: d.update(index_dtype="fp8"), r"index_dtype='fp8': must be one of "),
        (lambda d: d.update(producers=[5, 1]), r"producers=\(5, 1\): must be a tuple of distinct layer ids"),
        (lambda d: d.update(producers=[1, 1]), r"producers=\(1, 1\): must be a tuple of distinct layer ids"),
        (lambda d: d.update(sparse_layers=[0, 61]), r"sparse_layers=\(0, 61\): layer ids must be in 0\.\.60"),
        (
            lambda d: d.update(sparse_layers=[0, 1], producers=[0, 5]),
            r"producers=\(0, 5\): layers \[5\] are not sparse",
        ),
        (lambda d: d.update(producers=[]), r"producers=\(\): must include the first sparse layer \(0\)"),
        (lambda d: d.update(producers=[1, 5]), r"producers=\(1, 5\): must include the first sparse layer \(0\)"),
    ],
)
def test_bad_payload(edit, message):
    data = v32().to_dict()  # the fields are checked before the signature
    edit(data)
    with pytest.raises(DescriptorError, match=message):
        Descriptor.from_dict(data)


def test_bad_json_text():
    with pytest.raises(DescriptorError, match="descriptor: not valid JSON"):
        Descriptor.from_json("{not json")
    with pytest.raises(ValueError, match=r"descriptor must be a JSON object, got list"):
        Descriptor.from_json("[1, 2]")
    text = v32().to_json()
    with pytest.raises(DescriptorError, match="descriptor: key 'top_k' appears twice"):
        Descriptor.from_json(text.replace('"top_k":', '"top_k": 1, "top_k":', 1))


# --- prefill ranks ------------------------------------------------------------------------------


def test_ranks_that_agree():
    d = v32(index_topk_freq=4)
    assert check_ranks_agree([d, Descriptor.from_json(d.to_json()), d]) == d
    assert check_ranks_agree([None, None]) is None


def test_ranks_some_silent():
    d = v32()
    with pytest.raises(
        ValueError, match=r"prefill ranks \[1, 3\] report no descriptor while ranks \[0, 2\] report one"
    ):
        check_ranks_agree([d, None, d, None])


def test_ranks_disagree():
    a, b = v32(), v32(index_topk_freq=4)
    with pytest.raises(
        ValueError, match=r"prefill ranks report 2 different descriptors: ranks \[0, 2\]: .*ranks \[1\]"
    ):
        check_ranks_agree([a, b, a])


def test_ranks_disagree_on_layout():
    with pytest.raises(ValueError, match=r"2 different descriptors: .*; they differ in page_size "
                                         r"\(ranks \[0, 2\]: 64, ranks \[1\]: 1\)$"):
        check_ranks_agree([v32(), v32(page_size=1), v32()])
    # Every differing field is named, the producers among them.
    with pytest.raises(ValueError, match=r"they differ in top_k \(ranks \[0\]: 2048, ranks \[1\]: 512\); "
                                         r"index_dtype \(ranks \[0\]: 'float8_e4m3fn', ranks \[1\]: 'bfloat16'\); "
                                         r"producers \(ranks \[0\]: \(0, 1, 2, .*\), ranks \[1\]: \(0, 1, 5, .*\)\)$"):
        check_ranks_agree([v32(), v32(index_topk=512, index_dtype="bfloat16", index_topk_freq=4)])


def test_no_ranks():
    with pytest.raises(ValueError, match=r"no prefill ranks reported"):
        check_ranks_agree([])


def test_arguments_that_are_not_descriptors_are_named():
    d = v32()
    message = r"^plan: expected a LayerPlan \(LayerPlan.from_config reads a config\), got str$"
    with pytest.raises(TypeError, match=message):
        Descriptor.from_plan("examples/configs/deepseek-v3.2.json")  # it raised AttributeError on str.num_layers
    with pytest.raises(TypeError, match=r"^plan: expected a LayerPlan .*, got dict$"):
        Descriptor.from_plan({"num_hidden_layers": 61})
    message = r"decode: expected a Descriptor \(Descriptor.from_json reads a payload\), got dict"
    with pytest.raises(TypeError, match=message):
        check_pd_compatible(d, d.to_dict())
    with pytest.raises(TypeError, match=r"prefill: expected a Descriptor .*, got str"):
        check_pd_compatible(d.to_json(), d)
    with pytest.raises(TypeError, match=r"reports\[0\]: expected a Descriptor .*, got str"):
        check_ranks_agree([d.to_json(), d.to_json()])  # payloads that agree were returned as they came
    with pytest.raises(TypeError, match=r"reports\[1\]: expected a Descriptor .*, got dict"):
        check_ranks_agree([d, d.to_dict()])
