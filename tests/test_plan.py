"""LayerPlan: every config form, SGLang's precedence, validation messages, pipeline stages."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexcache.plan import INDEX_DTYPES, ConfigError, LayerPlan

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "configs"
V4_EXAMPLE_RATIOS = [0, 0, 4, 128, 4, 128, 4, 128, 4, 0]
V4_FLASH_RATIOS = [0, 0] + [4 if layer % 2 == 0 else 128 for layer in range(2, 43)]


def skip_pairs(plan: LayerPlan) -> list[tuple[bool, bool]]:
    """SGLang's (skip_topk, next_skip_topk) per sparse layer."""
    return [(plan.role(layer) == "S", plan.keeps_topk(layer)) for layer in plan.sparse_layers]


# --- worked examples: the producer counts of shipped models (V3.2, GLM-5, V4) under their freq rule ---------


def test_deepseek_v32_freq4_has_16_producers():
    plan = LayerPlan(61, index_topk_freq=4)
    assert plan.producers == [0, 1, *range(5, 58, 4)]
    assert len(plan.producers) == 16
    assert len(plan.shared) == 45
    assert plan.roles.startswith("FFSSSFSSSF")


@pytest.mark.parametrize(("layers", "producers"), [(61, 16), (78, 21), (47, 13)])
def test_dsa_rule_producer_counts(layers, producers):
    assert len(LayerPlan(layers, index_topk_freq=4).producers) == producers


def test_glm52_freq4_offset3_has_21_of_78():
    plan = LayerPlan(78, index_topk_freq=4, index_skip_topk_offset=3)
    assert plan.producers == [0, 1, 2, *range(6, 78, 4)]
    assert len(plan.producers) == 21
    assert plan.num_layers == 78


def test_default_offset_is_the_dsa_rule():
    for layers in (1, 2, 9, 61):
        for freq in (1, 2, 3, 4, 7):
            dsa = "".join("S" if max(layer - 1, 0) % freq else "F" for layer in range(layers))
            assert LayerPlan(layers, index_topk_freq=freq).roles == dsa
            assert LayerPlan(layers, index_topk_freq=freq, index_skip_topk_offset=2).roles == dsa


def test_v4_flash_freq4_counts_c4_rank():
    plan = LayerPlan(43, compress_ratios=V4_FLASH_RATIOS, index_topk_freq=4, index_topk=512)
    assert len(plan.sparse_layers) == 21
    assert plan.sparse_layers == list(range(2, 43, 2))
    assert plan.producers == [2, 10, 18, 26, 34, 42]  # C4 ranks 0, 4, 8, 12, 16, 20
    assert plan.top_k == 512
    assert all(plan.role(layer) is None for layer in range(43) if layer not in plan.sparse_layers)


def test_v4_short_example_freq4():
    plan = LayerPlan(10, compress_ratios=V4_EXAMPLE_RATIOS, index_topk_freq=4)
    assert plan.sparse_layers == [2, 4, 6, 8]
    assert plan.roles == "..F.S.S.S."
    assert skip_pairs(plan) == [(False, True), (True, True), (True, True), (True, False)]


def test_v4_short_example_pattern_per_c4_layer():
    plan = LayerPlan(10, compress_ratios=V4_EXAMPLE_RATIOS, index_topk_pattern="FSSF")
    assert plan.roles == "..F.S.S.F."
    assert skip_pairs(plan) == [(False, True), (True, True), (True, False), (False, False)]


def test_v4_pattern_per_layer_reads_only_c4_positions():
    # Characters at layers without an indexer are ignored (but must still be F/S).
    plan = LayerPlan(10, compress_ratios=V4_EXAMPLE_RATIOS, index_topk_pattern="SSFFSSSFFF")
    assert plan.roles == "..F.S.S.F."


def test_null_freq_means_one():
    plan = LayerPlan.from_config({"num_hidden_layers": 5, "index_topk_freq": None})
    assert plan.roles == "FFFFF"
    assert plan.shared == []
    assert LayerPlan(5).roles == "FFFFF"


# --- the other forms and the precedence ---------------------------------------------------------


def test_cli_factor():
    assert LayerPlan(7, cli_factor=3).roles == "FSSFSSF"
    assert LayerPlan(7, cli_factor=3).schedule == "cli_factor"


def test_cli_factor_one_falls_through_to_pattern_then_freq():
    assert LayerPlan(4, cli_factor=1, index_topk_pattern="FSFS").roles == "FSFS"
    assert LayerPlan(4, cli_factor=1, index_topk_freq=2).roles == "FFSF"
    assert LayerPlan(4, cli_factor=1, index_topk_freq=2).schedule == "index_topk_freq"


def test_indexer_types_per_layer_and_per_sparse_layer():
    types = ["full", "shared", "full", "shared"]
    assert LayerPlan(4, indexer_types=types).roles == "FSFS"
    v4 = LayerPlan(10, compress_ratios=V4_EXAMPLE_RATIOS, indexer_types=types)
    assert v4.roles == "..F.S.F.S."
    assert v4.schedule == "indexer_types"


def test_precedence_indexer_types_then_cli_factor_then_pattern_then_freq():
    everything = dict(
        indexer_types=["full", "full", "shared", "shared", "shared", "shared"],
        cli_factor=2,
        index_topk_pattern="FSSSSF",
        index_topk_freq=3,
    )
    assert LayerPlan(6, **everything).roles == "FFSSSS"
    everything.pop("indexer_types")
    assert LayerPlan(6, **everything).roles == "FSFSFS"
    everything.pop("cli_factor")
    assert LayerPlan(6, **everything).roles == "FSSSSF"
    everything.pop("index_topk_pattern")
    assert LayerPlan(6, **everything).roles == "FFSSFS"


def test_mtp_layers_come_last_and_always_compute():
    plan = LayerPlan(61, index_topk_freq=4, num_nextn_predict_layers=2)
    assert plan.num_layers == 63
    assert plan.num_mtp_layers == 2
    assert plan.roles[:61] == LayerPlan(61, index_topk_freq=4).roles
    assert plan.roles[61:] == "FF"
    assert plan.producers[-2:] == [61, 62]


def test_mtp_layers_with_compress_ratios():
    # A ratio list that covers the MTP layer decides whether it has an indexer at all.
    covered = LayerPlan(
        10, compress_ratios=[*V4_EXAMPLE_RATIOS, 0], index_topk_freq=4, num_nextn_predict_layers=1
    )
    assert covered.roles == "..F.S.S.S.."
    c4 = LayerPlan(10, compress_ratios=[*V4_EXAMPLE_RATIOS, 4], index_topk_freq=4, num_nextn_predict_layers=1)
    assert c4.roles == "..F.S.S.S.F"
    uncovered = LayerPlan(
        10, compress_ratios=V4_EXAMPLE_RATIOS, index_topk_freq=4, num_nextn_predict_layers=1
    )
    assert uncovered.roles == "..F.S.S.S.F"


def test_explicit_offset_applies_to_c4_rank():
    plan = LayerPlan(10, compress_ratios=V4_EXAMPLE_RATIOS, index_topk_freq=2, index_skip_topk_offset=2)
    assert plan.roles == "..F.F.S.F."  # ranks 0..3: max(r - 1, 0) % 2 -> F F S F


def test_no_sparse_layer_at_all():
    plan = LayerPlan(3, compress_ratios=[0, 128, 0], index_topk_freq=4)
    assert plan.roles == "..."
    assert plan.producers == [] and plan.sparse_layers == []
    assert plan.split_stages([1], mode="promote")[1].carry_in is None


# --- per-layer queries --------------------------------------------------------------------------


def test_source_of_role_and_sources():
    plan = LayerPlan(10, compress_ratios=V4_EXAMPLE_RATIOS, index_topk_freq=4)
    assert [plan.source_of(layer) for layer in range(10)] == [None, None, 2, None, 2, None, 2, None, 2, None]
    assert [plan.role(layer) for layer in (0, 2, 4)] == [None, "F", "S"]
    assert plan.sources == {4: 2, 6: 2, 8: 2}
    v32 = LayerPlan(61, index_topk_freq=4)
    assert v32.source_of(0) == 0 and v32.source_of(1) == 1
    assert v32.source_of(4) == 1 and v32.source_of(5) == 5 and v32.source_of(60) == 57


@pytest.mark.parametrize("layer", [-1, 10, True, 2.0])
def test_layer_out_of_range(layer):
    plan = LayerPlan(10)
    with pytest.raises(IndexError, match=r"layer .* is not in 0\.\.9"):
        plan.source_of(layer)


def test_index_k_cache_only_for_producers():
    plan = LayerPlan(10, compress_ratios=V4_EXAMPLE_RATIOS, index_topk_pattern="FSSF")
    assert plan.index_k_cache_layers == frozenset({2, 8})
    assert [layer for layer in range(10) if plan.needs_index_k_cache(layer)] == [2, 8]


def test_descriptor_fields_kept_on_the_plan():
    plan = LayerPlan(
        4, index_topk=2051, index_n_heads=32, index_head_dim=64, index_dtype="float8_e4m3fnuz", page_size=1
    )
    assert (plan.top_k, plan.index_n_heads, plan.index_head_dim) == (2051, 32, 64)
    assert (plan.index_dtype, plan.page_size) == ("float8_e4m3fnuz", 1)
    default = LayerPlan(4)
    assert (default.top_k, default.index_n_heads, default.index_head_dim) == (2048, 64, 128)
    assert (default.index_dtype, default.page_size) == ("float8_e4m3fn", 64)


# --- from_config --------------------------------------------------------------------------------


def test_from_config_reads_every_key():
    cfg = {
        "num_layers": 10,
        "compress_ratios": V4_EXAMPLE_RATIOS,
        "index_topk_pattern": "FSSF",
        "index_topk": 512,
        "index_n_heads": 32,
        "index_head_dim": 64,
        "num_nextn_predict_layers": 1,
        "unrelated_key": "ignored",
    }
    plan = LayerPlan.from_config(cfg)
    assert plan.roles == "..F.S.S.F.F"
    assert (plan.top_k, plan.index_n_heads, plan.index_head_dim, plan.num_mtp_layers) == (512, 32, 64, 1)


def test_from_config_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 61, "index_topk_freq": 4}))
    assert LayerPlan.from_config(path).producers == LayerPlan(61, index_topk_freq=4).producers
    assert LayerPlan.from_config(str(path)).roles == LayerPlan(61, index_topk_freq=4).roles


# Keys of DeepSeek-V3.2 / GLM-5 / DeepSeek-V4 style config.json files that indexcache does not read: none may
# be taken for a misspelt schedule key.
REAL_CONFIG_KEYS = """architectures attention_bias attention_dropout auto_map bos_token_id eos_token_id ep_size
first_k_dense_replace hidden_act hidden_size initializer_range intermediate_size kv_lora_rank max_position_embeddings
model_type moe_intermediate_size moe_layer_freq n_group n_routed_experts n_shared_experts norm_topk_prob
num_attention_heads num_experts_per_tok num_key_value_heads q_lora_rank qk_nope_head_dim qk_rope_head_dim
quantization_config rms_norm_eps rope_scaling rope_theta routed_scaling_factor scoring_func tie_word_embeddings
topk_group topk_method torch_dtype transformers_version use_cache v_head_dim vocab_size indexer_rope_interleave
rope_parameters compress_rope_theta o_lora_rank o_groups sliding_window hc_mult num_hash_layers swiglu_limit
index_rope_theta head_dim dtype indexer_topk indexer_n_heads indexer_head_dim layer_types _comment""".split()


def test_unknown_keys_of_real_configs_are_ignored():
    cfg = {"num_hidden_layers": 6, "index_topk_freq": 2, **dict.fromkeys(REAL_CONFIG_KEYS, 1)}
    assert LayerPlan.from_config(cfg).roles == LayerPlan(6, index_topk_freq=2).roles


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_every_accepted_index_dtype(dtype):
    assert LayerPlan.from_config({"num_hidden_layers": 2, "index_dtype": dtype}).index_dtype == dtype


def test_num_hidden_layers_wins_over_num_layers():
    assert LayerPlan.from_config({"num_hidden_layers": 3, "num_layers": 5}).num_layers == 3


@pytest.mark.parametrize(
    ("name", "producers"),
    [("deepseek-v3.2.json", 16), ("glm-5.2.json", 21), ("deepseek-v4-flash.json", 6)],
)
def test_example_configs(name, producers):
    assert len(LayerPlan.from_config(EXAMPLES / name).producers) == producers


def test_overrides_replace_keys_and_drop_higher_precedence():
    cfg = {
        "num_hidden_layers": 6,
        "indexer_types": ["full"] * 6,
        "cli_factor": 3,
        "index_topk_pattern": "FFFFFF",
    }
    assert LayerPlan.from_config(cfg).roles == "FFFFFF"
    assert LayerPlan.from_config(cfg, index_topk_freq=2).roles == "FFSFSF"
    assert LayerPlan.from_config(cfg, index_skip_topk_offset=1, index_topk_freq=2).roles == "FSFSFS"
    assert LayerPlan.from_config(cfg, index_topk_pattern="FSSSSS").roles == "FSSSSS"
    # cli_factor keeps precedence over a pattern from the config but not over an overriding one
    assert LayerPlan.from_config(cfg, cli_factor=2).roles == "FSFSFS"
    # None means "no override"
    assert LayerPlan.from_config(cfg, index_topk_freq=None, page_size=None).roles == "FFFFFF"
    assert LayerPlan.from_config(cfg, page_size=16).page_size == 16


# --- validation: one test per bad input, each checks key, value and rule --------------------------

BAD_INPUTS = [
    (
        {"index_topk_freq": True},
        r"index_topk_freq=True: must be an integer >= 1 \(null means 1\); bools and floats",
    ),
    ({"index_topk_freq": 2.5}, r"index_topk_freq=2\.5: must be an integer >= 1"),
    ({"index_topk_freq": 4.0}, r"index_topk_freq=4\.0: must be an integer >= 1"),
    ({"index_topk_freq": 0}, r"index_topk_freq=0: must be an integer >= 1"),
    ({"index_topk_freq": -4}, r"index_topk_freq=-4: must be an integer >= 1"),
    ({"index_topk_freq": "4"}, r"index_topk_freq='4': must be an integer >= 1"),
    ({"index_skip_topk_offset": 0}, r"index_skip_topk_offset=0: must be an integer >= 1 \(skip\(l\) = max"),
    ({"index_skip_topk_offset": -1}, r"index_skip_topk_offset=-1: must be an integer >= 1"),
    ({"cli_factor": 0}, r"cli_factor=0: must be an integer >= 1"),
    ({"cli_factor": -2}, r"cli_factor=-2: must be an integer >= 1"),
    (
        {"index_topk_pattern": "FSXF"},
        r"index_topk_pattern='FSXF': position 2 is 'X'; only 'F' or 'S' are allowed",
    ),
    ({"index_topk_pattern": "fssf"}, r"index_topk_pattern='fssf': position 0 is 'f'; only 'F' or 'S'"),
    ({"index_topk_pattern": "FSF"}, r"index_topk_pattern='FSF': has 3 entries, not the layer count \(4\)"),
    ({"index_topk_pattern": ""}, r"index_topk_pattern='': has 0 entries, not the layer count \(4\)"),
    (
        {"index_topk_pattern": "SFFF"},
        r"index_topk_pattern='SFFF': the first sparse layer \(layer 0\) is 'S', .* it must be 'F'",
    ),
    ({"index_topk_pattern": ["F"] * 4}, r"index_topk_pattern=\['F', .*\]: must be a string of 'F' or 'S'"),
    (
        {"indexer_types": ["full", "half", "full", "full"]},
        r"indexer_types=\[.*\]: position 1 is 'half'; only 'full' or 'shared' are allowed",
    ),
    (
        {"indexer_types": ["full", "shared"]},
        r"indexer_types=\['full', 'shared'\]: has 2 entries, not the layer count",
    ),
    (
        {"indexer_types": ["shared", "full", "full", "full"]},
        r"indexer_types=\[.*\]: the first sparse layer \(layer 0\) is 'shared', .* it must be 'full'",
    ),
    ({"indexer_types": "full"}, r"indexer_types='full': must be a list of 'full' or 'shared'"),
    (
        {"compress_ratios": [0, 4, -4, 4]},
        r"compress_ratios\[2\]=-4: layer 2's compression ratio must be one of 0 \(sliding window\), 4 \(C4",
    ),
    (
        {"compress_ratios": [0, 4, 4]},
        r"compress_ratios=\[0, 4, 4\]: has 3 entries; expected one per layer \(4, MTP",
    ),
    (
        {"compress_ratios": [0, 4, 4.0, 4]},
        r"compress_ratios\[2\]=4\.0: layer 2's compression ratio must be one of 0 ",
    ),
    (
        {"compress_ratios": [0, 4, 8, 4]},
        r"compress_ratios\[2\]=8: layer 2's compression ratio must be one of .*, 128 \(HCA\)",
    ),
    ({"compress_ratios": "4444"}, r"compress_ratios='4444': must be a list of integers, one per layer"),
    ({"num_nextn_predict_layers": -1}, r"num_nextn_predict_layers=-1: must be an integer >= 0"),
    ({"index_topk": 0}, r"index_topk=0: must be an integer >= 1"),
    ({"index_n_heads": 0}, r"index_n_heads=0: must be an integer >= 1"),
    ({"index_head_dim": 1.5}, r"index_head_dim=1\.5: must be an integer >= 1"),
    ({"page_size": 0}, r"page_size=0: must be an integer >= 1"),
    ({"index_dtype": ""}, r"index_dtype='': must be one of 'float8_e4m3fn', 'float8_e4m3fnuz', 'bfloat16'"),
    ({"index_dtype": "bf16"}, r"index_dtype='bf16': must be one of .*; did you mean 'bfloat16'\?"),
    ({"index_topk_frequency": 4}, r"config key 'index_topk_frequency': .* did you mean 'index_topk_freq'\?"),
]


@pytest.mark.parametrize(
    ("extra", "message"), BAD_INPUTS, ids=[re.sub(r"\W+", "-", m)[:40] for _, m in BAD_INPUTS]
)
def test_bad_input_names_key_value_and_rule(extra, message):
    with pytest.raises(ConfigError, match=message):
        LayerPlan.from_config({"num_hidden_layers": 4, **extra})


def test_first_sparse_layer_shared_in_a_c4_model():
    with pytest.raises(
        ValueError, match=r"index_topk_pattern='SSSF': the first sparse layer \(layer 2\) is 'S'"
    ):
        LayerPlan(10, compress_ratios=V4_EXAMPLE_RATIOS, index_topk_pattern="SSSF")
    with pytest.raises(
        ValueError, match=r"has 5 entries, neither the layer count \(10\) nor the sparse layer count \(4\)"
    ):
        LayerPlan(10, compress_ratios=V4_EXAMPLE_RATIOS, index_topk_pattern="FSSFS")


def test_a_bad_key_is_refused_even_when_a_higher_precedence_key_decides():
    with pytest.raises(ValueError, match=r"index_topk_freq=0"):
        LayerPlan(4, indexer_types=["full"] * 4, index_topk_freq=0)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"index_topk_freq": 4}, r"config has no layer count: expected num_hidden_layers or num_layers"),
        ({"num_hidden_layers": None, "index_topk_freq": 4}, r"config has no layer count"),
        ({"num_hidden_layers": 0}, r"num_hidden_layers=0: must be an integer >= 1"),
        ({"num_layers": True}, r"num_layers=True: must be an integer >= 1"),
        ([61], r"config must be a JSON object \(a dict\), got list"),
    ],
)
def test_bad_layer_count_or_config(config, message):
    with pytest.raises(ConfigError, match=message):
        LayerPlan.from_config(config)


def test_invalid_json_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        LayerPlan.from_config(path)


def test_a_key_given_twice_is_refused(tmp_path):
    """json keeps the last of duplicate keys silently: a config whose schedule was set twice ran the last one."""
    path = tmp_path / "config.json"
    path.write_text('{"num_hidden_layers": 4, "index_topk_freq": 1, "index_topk_freq": 4}')
    with pytest.raises(ConfigError, match=r"config\.json: key 'index_topk_freq' appears twice in one object"):
        LayerPlan.from_config(path)
    path.write_text('{"num_hidden_layers": 4, "text_config": {"a": 1, "b": 2}, "index_topk_freq": 4}')
    assert LayerPlan.from_config(path).num_layers == 4  # the same name in two objects is no duplicate


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        LayerPlan.from_config("/nonexistent/config.json")


def test_unknown_override():
    with pytest.raises(ConfigError, match=r"overrides \['index_topk_freqs'\]: unknown keys"):
        LayerPlan.from_config({"num_hidden_layers": 4}, index_topk_freqs=4)


# --- pipeline stages ----------------------------------------------------------------------------


def test_carry_stages_name_the_producer_crossing_each_boundary():
    stages = LayerPlan(61, index_topk_freq=4).split_stages([15, 30, 45])
    assert [(s.start, s.stop) for s in stages] == [(0, 15), (15, 30), (30, 45), (45, 61)]
    assert [s.carry_in for s in stages] == [None, 13, 29, None]
    assert [s.carry_out for s in stages] == [13, 29, None, None]
    assert stages[1].roles == "SSFSSSFSSSFSSSF"
    assert stages[1].producers == [17, 21, 25, 29] and stages[1].shared[:2] == [15, 16]
    assert all(s.promoted == () for s in stages)


def test_carry_passes_through_a_stage_without_sparse_layers():
    stages = LayerPlan(10, compress_ratios=V4_EXAMPLE_RATIOS, index_topk_freq=4).split_stages([3, 4, 5])
    assert [s.roles for s in stages] == ["..F", ".", "S", ".S.S."]
    assert [(s.carry_in, s.carry_out) for s in stages] == [(None, 2), (2, 2), (2, 2), (2, None)]


def test_promote_makes_each_stage_start_with_a_producer():
    plan = LayerPlan(61, index_topk_freq=4)
    stages = plan.split_stages([15, 30, 45], mode="promote")
    assert [s.promoted for s in stages] == [(), (15,), (30,), ()]
    assert stages[1].roles == "FSFSSSFSSSFSSSF"
    assert all(s.carry_in is None and s.carry_out is None for s in stages)
    assert plan.roles[15] == "S"  # the plan itself is unchanged


def test_promote_skips_to_the_first_sparse_layer_of_a_stage():
    plan = LayerPlan(10, compress_ratios=V4_EXAMPLE_RATIOS, index_topk_freq=4)
    stages = plan.split_stages([3, 5], "promote")
    assert [s.roles for s in stages] == ["..F", ".F", ".F.S."]
    assert [s.promoted for s in stages] == [(), (4,), (6,)]
    assert [s.carry_in for s in stages] == [None, None, None]


def test_promote_refused_for_indexer_types():
    plan = LayerPlan(4, indexer_types=["full", "shared", "shared", "full"])
    assert [s.carry_in for s in plan.split_stages([2])] == [None, 0]
    assert plan.split_stages([3], mode="promote")[1].promoted == ()  # stage starts on a producer: fine
    with pytest.raises(ValueError, match=r"mode='promote': .* layer 2 .* indexer_types marks it 'shared'"):
        plan.split_stages([2], mode="promote")


def test_for_stage_runs_the_stage_roles_over_its_layers():
    plan = LayerPlan(61, index_topk_freq=4)
    carry, promote = plan.split_stages([15])[1], plan.split_stages([15], mode="promote")[1]
    assert plan.for_stage(carry).roles == plan.roles
    staged = plan.for_stage(promote)
    assert staged.roles == plan.roles[:15] + promote.roles and staged.role(15) == "F" and plan.role(15) == "S"
    assert staged.source_of(16) == 15 and plan.source_of(16) == 13
    assert (staged.top_k, staged.page_size, staged.schedule) == (plan.top_k, plan.page_size, plan.schedule)
    other = LayerPlan(10).split_stages([5])[1]
    with pytest.raises(ConfigError, match=r"stage: layers 5\.\.9 do not fit the plan's 8 layers"):
        LayerPlan(8).for_stage(other)
    v4 = LayerPlan(10, compress_ratios=V4_EXAMPLE_RATIOS)  # "..F.F.F.F.": another sparse layout, same span
    with pytest.raises(ConfigError, match=r"stage: roles 'FFFFF' over layers 5\.\.9 are not this plan's \('\.F\.F\.'"):
        v4.for_stage(other)
    demoted = LayerPlan(10, index_topk_freq=2).split_stages([5])[1]  # producers of LayerPlan(10) turned shared
    with pytest.raises(ConfigError, match=r"stage: roles 'FSFSF' over layers 5\.\.9 are not this plan's \('FFFFF'"):
        LayerPlan(10).for_stage(demoted)
    with pytest.raises(TypeError, match=r"stage: expected a Stage \(from split_stages\), got tuple"):
        plan.for_stage((15, 61))


def test_no_boundaries_is_one_stage():
    plan = LayerPlan(5, index_topk_freq=2)
    (stage,) = plan.split_stages([])
    assert (stage.start, stage.stop, stage.roles) == (0, 5, plan.roles)
    assert stage.carry_in is None and stage.carry_out is None


@pytest.mark.parametrize("boundaries", [[0], [5], [3, 2], [2, 2], [True], [2.0], [-1]])
def test_bad_boundaries(boundaries):
    with pytest.raises(ValueError, match=r"boundaries=.*: must be strictly increasing layer ids in 1\.\.4"):
        LayerPlan(5).split_stages(boundaries)


def test_boundaries_that_are_not_a_list():
    with pytest.raises(TypeError, match=r"boundaries=3: expected a list of layer ids, got int"):
        LayerPlan(5).split_stages(3)


def test_bad_mode():
    with pytest.raises(ValueError, match=r"mode='copy': must be 'carry' or 'promote'"):
        LayerPlan(5).split_stages([2], mode="copy")


# --- properties ---------------------------------------------------------------------------------


@st.composite
def plans(draw) -> LayerPlan:
    layers = draw(st.integers(1, 40))
    ratios = draw(st.none() | st.lists(st.sampled_from([0, 4, 4, 128]), min_size=layers, max_size=layers))
    sparse = [layer for layer in range(layers) if ratios is None or ratios[layer] == 4]
    kwargs = {"compress_ratios": ratios, "num_nextn_predict_layers": draw(st.integers(0, 2))}
    form = draw(st.sampled_from(["freq", "cli_factor", "pattern", "indexer_types"]))
    if form == "freq":
        kwargs["index_topk_freq"] = draw(st.none() | st.integers(1, 8))
        kwargs["index_skip_topk_offset"] = draw(st.none() | st.integers(1, 6))
    elif form == "cli_factor":
        kwargs["cli_factor"] = draw(st.integers(1, 6))
    else:
        per_sparse = draw(st.lists(st.booleans(), min_size=len(sparse), max_size=len(sparse)))
        per_sparse[:1] = [False] * len(per_sparse[:1])
        if draw(st.booleans()):
            skips = iter(per_sparse)
            per_layer = [next(skips) if layer in sparse else draw(st.booleans()) for layer in range(layers)]
            per_sparse = per_layer
        if form == "pattern":
            kwargs["index_topk_pattern"] = "".join("S" if s else "F" for s in per_sparse)
        else:
            kwargs["indexer_types"] = ["shared" if s else "full" for s in per_sparse]
    return LayerPlan(layers, **kwargs)


@settings(max_examples=50, deadline=None)
@given(plans())
def test_every_shared_layer_reuses_the_nearest_earlier_producer(plan):
    for layer in plan.shared:
        source = plan.source_of(layer)
        assert source < layer and plan.role(source) == "F"
        assert all(plan.role(between) != "F" for between in range(source + 1, layer))
    assert plan.sources == {layer: plan.source_of(layer) for layer in plan.shared}
    assert sorted(plan.producers + plan.shared) == plan.sparse_layers
    assert plan.index_k_cache_layers == frozenset(plan.producers)


@settings(max_examples=50, deadline=None)
@given(plans())
def test_first_sparse_layer_is_a_producer(plan):
    if plan.sparse_layers:
        assert plan.role(plan.sparse_layers[0]) == "F"


@settings(max_examples=50, deadline=None)
@given(plans(), st.data())
def test_carry_split_keeps_the_unsplit_roles(plan, data):
    inner = list(range(1, plan.num_layers))
    boundaries = sorted(data.draw(st.sets(st.sampled_from(inner), max_size=4))) if inner else []
    stages = plan.split_stages(boundaries, mode="carry")
    assert "".join(s.roles for s in stages) == plan.roles
    assert [s.start for s in stages] == [0, *boundaries]
    for stage in stages:
        later = [layer for layer in plan.sparse_layers if layer >= stage.start]
        if later and plan.role(later[0]) == "S":
            assert stage.carry_in == plan.source_of(later[0])
        else:
            assert stage.carry_in is None
    assert [s.carry_out for s in stages[:-1]] == [s.carry_in for s in stages[1:]]
    assert stages[-1].carry_out is None


@settings(max_examples=50, deadline=None)
@given(plans(), st.data())
def test_promote_split_needs_no_carry(plan, data):
    inner = list(range(1, plan.num_layers))
    boundaries = sorted(data.draw(st.sets(st.sampled_from(inner), max_size=4))) if inner else []
    if plan.schedule == "indexer_types":
        return
    stages = plan.split_stages(boundaries, mode="promote")
    for stage in stages:
        assert stage.carry_in is None and stage.carry_out is None
        first = stage.roles.replace(".", "")[:1]
        assert first in ("", "F")
        assert all(plan.role(layer) == "S" for layer in stage.promoted)
    promoted = {layer for s in stages for layer in s.promoted}
    split = "".join(s.roles for s in stages)
    assert split == "".join("F" if layer in promoted else r for layer, r in enumerate(plan.roles))


def test_a_multimodal_config_is_read_from_its_text_config():
    """Hugging Face nests a multimodal model's language model under ``text_config``: such a config had no layer count
    at its top level and was refused; it is read from the nested object, its misspelt keys refused there too."""
    inner = {"num_hidden_layers": 8, "index_topk_freq": 4, "index_topk": 512}
    plan = LayerPlan.from_config({"model_type": "vl", "vision_config": {"depth": 24}, "text_config": inner})
    assert plan.roles == LayerPlan.from_config(inner).roles == "FFSSSFSS"
    with pytest.raises(ConfigError, match=r"config key 'index_topk_frq'.*did you mean 'index_topk_freq'"):
        LayerPlan.from_config({"text_config": {"num_hidden_layers": 8, "index_topk_frq": 4}})


def test_a_layer_count_beside_a_text_config_with_schedule_keys_is_refused():
    """A top-level layer count with the schedule under ``text_config``: the schedule was ignored without a word (every
    layer a producer)."""
    with pytest.raises(ConfigError, match=r"layer count at its top level and 'index_topk_freq' under text_config"):
        LayerPlan.from_config({"num_hidden_layers": 8, "text_config": {"index_topk_freq": 4}})
    plan = LayerPlan.from_config({"num_hidden_layers": 8, "index_topk_freq": 4, "text_config": {"vocab_size": 5}})
    assert plan.roles == "FFSSSFSS"


def test_schedule_keys_beside_a_text_config_that_holds_the_layer_count_are_refused():
    """A multimodal config read from ``text_config`` with the schedule at its top level (where merging calibrate's
    ``{"index_topk_pattern": ...}`` into the model's config puts it): the top-level schedule was dropped without a
    word and every layer ran as a producer."""
    inner = {"num_hidden_layers": 8}
    with pytest.raises(ConfigError, match=r"'index_topk_freq' at its top level and its layer count under text_config"):
        LayerPlan.from_config({"text_config": inner, "index_topk_freq": 4})
    with pytest.raises(ConfigError, match=r"'index_topk_pattern' at its top level"):
        LayerPlan.from_config({"text_config": inner, "index_topk_pattern": "FSSSFSSS"})
    with pytest.raises(ConfigError, match=r"config key 'index_topk_frq'.*did you mean 'index_topk_freq'"):
        LayerPlan.from_config({"text_config": inner, "index_topk_frq": 4})
    plan = LayerPlan.from_config({"text_config": {**inner, "index_topk_freq": 4}, "index_topk_freq": None})
    assert plan.roles == "FFSSSFSS"  # null means unset, at the top level too
