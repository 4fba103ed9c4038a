"""attnopt.Policy: presets, dict/file parsing, matching, errors, safe loading, round-trips."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from attnopt import forms
from attnopt.passes.plan import plan_sites

from attnopt.policy import PolicyError
from attnopt.ir.site import AttentionSite, MaskInfo, SiteNodes
from attnopt.policy import Policy, Rule, hybrid_policy

NUM_LAYERS = 12


def make_site(layer=0, module="encoder.layer.0.attn", source="sdpa", q_len=128, kv_len=None, causal=False, arbitrary=False):
    kv = q_len if kv_len is None else kv_len
    mask = MaskInfo(form="is_causal" if causal else "none", causal=causal, arbitrary=arbitrary)
    return AttentionSite(
        id=f"{module}#0", module_path=module, module_type="Attn", layer=layer, source=source,
        batch=2, heads=4, kv_heads=4, q_len=q_len, kv_len=kv, head_dim=16, v_head_dim=16,
        scale=0.25, causal=causal, mask=mask, window=None, dropout_p=0.0, dtype="float32",
        nodes=SiteNodes(query="q", key="k", value="v", output="o"),
    )


def forms_by_layer(policy, n=NUM_LAYERS, **kw):
    out = []
    for layer in range(n):
        rule, _ = policy.choose(make_site(layer=layer, **kw), n)
        out.append(None if rule is None else rule.form)
    return out


# ---------------------------------------------------------------- presets


def test_simple_presets_are_one_rule_each():
    p = Policy.parse("exact")
    assert [(r.form, r.layers) for r in p.rules] == [("exact", None)] and not p.auto
    assert Policy.parse("keep").rules[0].form == "exact"
    lin = Policy.parse("linear").rules
    assert len(lin) == 1 and lin[0].form == "linear" and lin[0].params["feature_map"] == "elu"
    assert lin[0].params["num_features"] == 0 and lin[0].params["eps"] is None  # defaults filled (None: per map)
    assert Policy.parse("linear:favor").rules[0].params["feature_map"] == "favor"
    hh = Policy.parse("linear:hedgehog+num_features:64").rules[0].params
    assert (hh["feature_map"], hh["num_features"]) == ("hedgehog", 64)
    w = Policy.parse("window:256").rules[0].params
    assert (w["window"], w["sinks"]) == (256, 0)
    w = Policy.parse("window:256+sinks:4").rules[0].params
    assert (w["window"], w["sinks"]) == (256, 4)
    assert Policy.parse("ssm").rules[0].params["decay"] == "retnet"
    assert Policy.parse("ssm:0.9").rules[0].params["decay"] == 0.9
    assert Policy.parse("window:64+min_seq_len:128").rules[0].params["min_seq_len"] == 128


def test_reuse_preset_keeps_the_first_and_last_layers_exact():
    p = Policy.parse("reuse")
    r = p.rules[0]
    assert (r.form, r.params["top_k"], r.params["block"], r.params["anchor"], r.params["every"]) == \
        ("reuse", 16, 64, None, None)  # anchors measured
    assert forms_by_layer(p, 5) == [None, "reuse", "reuse", "reuse", None]
    assert Policy.parse("reuse:8+every:3").rules[0].params["top_k"] == 8
    # anchor two layers back: layers 0 and 1 have nothing to reuse
    assert forms_by_layer(Policy.parse("reuse+anchor:-2"), 5) == [None, None, "reuse", "reuse", None]


def test_hybrid_preset_layers():
    p = Policy.parse("hybrid")
    assert p == hybrid_policy()
    assert [r.form for r in p.rules] == ["exact", "exact", "window", "linear"]
    assert p.rules[2].params["window"] == 64 and p.rules[2].params["sinks"] == 4
    # 12 layers: 0 exact, 1..3 (33% of 12 = 3.96 -> 3) windowed, 4..10 linear, 11 exact
    assert forms_by_layer(p, 12) == ["exact"] + ["window"] * 3 + ["linear"] * 7 + ["exact"]
    assert forms_by_layer(p, 6) == ["exact", "window", "linear", "linear", "linear", "exact"]
    assert forms_by_layer(p, 2) == ["exact", "exact"]


def test_auto_preset_candidates_are_cheapest_first_and_respect_preconditions():
    p = Policy.parse("auto")
    assert p.auto and p.rules == ()
    assert p.choose(make_site(layer=3), NUM_LAYERS) == (None, -1)
    assert [f for f, _ in p.auto_candidates()] == ["linear", "ssm", "window", "reuse"]
    window_params = dict(p.auto_candidates())["window"]
    assert (window_params["window"], window_params["sinks"]) == (64, 4)

    # Applicability is the forms' why_not, asked by the planner (the policy only matches rules).
    def planned(*sites):
        return [[f for f, _ in plan.candidates] for plan in plan_sites(list(sites), p).plans]

    anchor = make_site(layer=2, q_len=512, causal=True)
    causal_long = make_site(layer=3, q_len=512, causal=True)
    assert planned(anchor, causal_long)[1] == ["linear", "ssm", "window", "reuse"]
    # layer 0: nothing to reuse; not causal: no ssm. (A window covering a 60-key site is planned:
    # verification decides, on inputs long enough for it to act.)
    first_short = make_site(layer=0, q_len=60, causal=False)
    (plan,) = plan_sites([first_short], p).plans
    assert [f for f, _ in plan.candidates] == ["linear", "window"]
    assert all(f"{f}:" in plan.reason for f in ("ssm", "reuse"))
    # an arbitrary mask is only honoured by exact attention
    assert planned(make_site(layer=3, q_len=512, arbitrary=True)) == [[]]
    assert Policy.parse("auto+tolerance:0.2").tolerance == 0.2


def test_tolerance_resolution_order():
    p = Policy.parse({"tolerance": 0.1, "rules": [{"form": "linear", "tolerance": 0.5}]})
    assert p.tolerance_for("linear", p.rules[0].params) == 0.5
    assert p.tolerance_for("window", {}) == 0.1
    assert Policy.parse("linear").tolerance_for("linear", {}) == forms.get("linear").default_tolerance
    assert Policy.parse("auto").tolerance == 0.3  # auto picks for the user: a tighter default bar


# ---------------------------------------------------------------- matching


def test_first_match_wins():
    p = Policy.parse({"rules": [{"layers": 2, "form": "exact"}, {"form": "window", "window": 32}, {"form": "linear"}]})
    rule, index = p.choose(make_site(layer=2), NUM_LAYERS)
    assert (rule.form, index) == ("exact", 0)
    rule, index = p.choose(make_site(layer=5), NUM_LAYERS)
    assert (rule.form, index, rule.params["window"]) == ("window", 1, 32)


def test_negative_layer_ranges_resolve_against_num_layers():
    p = Policy.parse({"rules": [{"layers": "-2..-1", "form": "linear"}]})
    assert forms_by_layer(p, 6) == [None, None, None, None, "linear", "linear"]
    assert forms_by_layer(p, 3) == [None, "linear", "linear"]
    p = Policy.parse({"rules": [{"layers": [1, -2], "form": "ssm"}]})
    assert forms_by_layer(p, 5) == [None, "ssm", "ssm", "ssm", None]
    p = Policy.parse({"rules": [{"layers": "2..", "form": "ssm"}, {"layers": "..0", "form": "linear"}]})
    assert forms_by_layer(p, 4) == ["linear", None, "ssm", "ssm"]


def test_module_glob_source_and_seq_len_filters():
    p = Policy.parse({"rules": [
        {"module": "*.crossattention*", "form": "exact"},
        {"source": ["explicit", "mha"], "form": "window", "window": 16},
        {"seq_len": [512, None], "form": "linear"},
    ]})
    def pick(**kw):
        rule, i = p.choose(make_site(**kw), NUM_LAYERS)
        return i
    assert pick(module="decoder.layer.1.crossattention.self") == 0
    assert pick(module="decoder.layer.1.attention.self", source="explicit") == 1
    assert pick(module="decoder.layer.1.attention.self", source="mha") == 1
    assert pick(source="sdpa", q_len=1024) == 2
    assert pick(source="sdpa", q_len=511) == -1
    assert pick(source="sdpa", q_len="s0") == 2  # symbolic lengths match any range
    bounded = Policy.parse({"rules": [{"seq_len": "64..128", "form": "linear"}]})
    assert [bounded.choose(make_site(q_len=n), 1)[1] for n in (63, 64, 128, 129)] == [-1, 0, 0, -1]


def test_describe_is_short_and_specific():
    rule = Policy.parse({"rules": [{"layers": "1..4", "module": "*.attn", "form": "window", "window": 64, "sinks": 4}]}).rules[0]
    assert rule.describe() == "layers 1..4, module '*.attn' → window(window=64, sinks=4)"
    assert "rule 0: layers 1..4" in str(Policy.parse({"rules": [rule.to_dict()]}))


# ---------------------------------------------------------------- files


def test_dict_with_nested_params_equals_inline_params():
    inline = Policy.parse({"rules": [{"form": "window", "window": 64, "sinks": 4}]})
    nested = Policy.parse({"rules": [{"form": "window", "params": {"window": 64, "sinks": 4}}]})
    assert inline.rules == nested.rules


def test_yaml_toml_json_files(tmp_path):
    yaml_text = """
name: seeds
tolerance: 0.2
rules:
  - layers: [0, 0]
    form: exact
  - layers: "-1"
    form: keep
  - layers: "1..4"
    module: "*.self_attn"
    source: sdpa
    seq_len: [512, null]
    form: window
    window: 64
    sinks: 4
  - form: linear
    params: {feature_map: favor, num_features: 32}
"""
    toml_text = """
name = "seeds"
tolerance = 0.2
[[rules]]
layers = [0, 0]
form = "exact"
[[rules]]
layers = "-1"
form = "keep"
[[rules]]
layers = "1..4"
module = "*.self_attn"
source = "sdpa"
seq_len = "512.."
form = "window"
window = 64
sinks = 4
[[rules]]
form = "linear"
params = { feature_map = "favor", num_features = 32 }
"""
    (tmp_path / "p.yaml").write_text(yaml_text)
    (tmp_path / "p.toml").write_text(toml_text)
    from_yaml = Policy.parse(tmp_path / "p.yaml")
    from_toml = Policy.parse(str(tmp_path / "p.toml"))
    assert from_yaml == from_toml
    assert from_yaml.name == "seeds" and from_yaml.tolerance == 0.2
    r = from_yaml.rules[2]
    assert (r.layers, r.module, r.source, r.seq_len) == ((1, 4), "*.self_attn", frozenset({"sdpa"}), (512, None))
    assert from_yaml.rules[1].form == "exact" and from_yaml.rules[1].layers == (-1, -1)
    assert from_yaml.rules[3].params["num_features"] == 32
    (tmp_path / "p.json").write_text(json.dumps(from_yaml.to_dict()))
    assert Policy.parse(tmp_path / "p.json") == from_yaml


def test_yaml_python_tag_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / "evil.yaml").write_text(f"rules: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(PolicyError, match="not valid YAML"):
        Policy.parse(tmp_path / "evil.yaml")
    assert not marker.exists()


def test_missing_file_is_a_policy_error(tmp_path):
    with pytest.raises(PolicyError, match="not found"):
        Policy.parse(str(tmp_path / "nope.yaml"))


def test_a_malformed_file_is_one_line_naming_where(tmp_path):
    (tmp_path / "bad.yaml").write_text('rules:\n  - {layers: "0", form: exact\n')
    with pytest.raises(PolicyError) as e:
        Policy.parse(tmp_path / "bad.yaml")
    assert "\n" not in str(e.value) and "is not valid YAML plain data" in str(e.value)
    assert str(e.value).endswith("at line 3, column 1")


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "spec, needles",
    [
        ("linearr", ["'linearr'", "exact", "hybrid", "auto"]),
        ({"rules": [{"form": "fast"}]}, ["rule 0", "'fast'", "linear", "window", "ssm"]),
        ({"rules": [{"form": "window", "windw": 3}]}, ["rule 0", "'windw'", "window", "sinks", "layers"]),
        ({"rules": [{"form": "exact"}, {"form": "linear", "feature_map": "cosine"}]}, ["rule 1", "feature_map", "'cosine'", "'elu'", "'favor'"]),
        ("linear:cosine", ["feature_map", "'cosine'", "'hedgehog'"]),
        ({"rules": [{"form": "window", "window": 0}]}, ["rule 0", "'window'", "0", ">= 1"]),
        ({"rules": [{"form": "exact", "layer": 3}]}, ["rule 0", "'layer'", "layers", "module", "seq_len"]),
        ({"rules": [{"form": "exact", "layers": "one..4"}]}, ["rule 0", "'one'", "negative", "%"]),
        ({"rules": [{"form": "exact", "layers": "4..1"}]}, ["rule 0", "'layers'", "'4..1'", "start..stop"]),
        ({"rules": [{"form": "exact", "source": "flash"}]}, ["rule 0", "'source'", "'flash'", "sdpa", "explicit", "mha"]),
        ({"rules": [{"form": "exact", "seq_len": [10, 5]}]}, ["rule 0", "'seq_len'", "min 10 > max 5"]),
        ({"rulez": []}, ["'rulez'", "rules", "tolerance", "name"]),
        ({"rules": [{"form": "linear", "params": {"num_features": -1}}]}, ["rule 0", "num_features", "-1", ">= 0"]),
        ({"tolerance": "tight"}, ["tolerance", "'tight'", "float"]),
        ("window:64+sinks", ["'sinks'", "key:value"]),
        ("exact:3", ["'exact'", "takes no ':arg'", "window:<window>"]),
    ],
)
def test_invalid_policies_name_field_value_and_allowed(spec, needles):
    with pytest.raises(PolicyError) as info:
        Policy.parse(spec)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} missing from {message!r}"


@pytest.mark.parametrize("spec, suggestion", [
    ("linaer", "'linear'"),  # a form name
    ("Hybird", "'hybrid'"),  # a recipe, any case
    ("gla+windw:16", "'gla+window:16'"),  # a form whose name holds a '+', parsed as gla plus a key
    ("windo:64+sinks:4", "'window:64+sinks:4'"),  # the rest of the preset kept
    ("window:64+sinkz:4", "'window:64+sinks:4'"),  # a parameter
    ("linear:favr", "'linear:favor'"),  # a value with fixed choices
    ("linear+window:64+map:hedgehg", "'linear+window:64+map:hedgehog'"),  # a short preset key's value
    ("auto+tolernce:0.2", "'auto+tolerance:0.2'"),  # a recipe's key
    ({"rules": [{"form": "lineer"}]}, "'linear'"),
    ({"rules": [{"form": "window", "sinkz": 4}]}, "'sinks'"),
    ({"rules": [{"form": "window", "params": {"windw": 4}}]}, "'window'"),
    ({"rules": [{"form": "exact", "layer": 3}]}, "'layers'"),
    ({"rules": [{"form": "linear", "feature_map": "hedgehg"}]}, "'hedgehog'"),
    ({"rules": [{"form": "exact", "source": "spda"}]}, "'sdpa'"),
    ({"rulez": []}, "'rules'"),
])
def test_a_typo_names_the_closest_spelling(spec, suggestion):
    with pytest.raises(PolicyError) as info:
        Policy.parse(spec)
    assert f"(did you mean {suggestion}?)" in str(info.value), str(info.value)
    if isinstance(spec, str):  # the preset it suggests is one that parses
        Policy.parse(suggestion.strip("'"))


def test_a_typo_with_nothing_close_suggests_nothing():
    for spec in ("zzz", "window:64+qqq:1", "linear:cosine", {"rules": [{"form": "window", "zz": 1}]}):
        with pytest.raises(PolicyError) as info:
            Policy.parse(spec)
        assert "did you mean" not in str(info.value)
    # 'windw' is close to 'window', but window given twice does not parse: no suggestion that fails
    with pytest.raises(PolicyError) as info:
        Policy.parse("linear+window:64+windw:3")
    assert "did you mean" not in str(info.value)


def test_a_rule_built_in_python_names_the_closest_form_and_parameter():
    with pytest.raises(PolicyError, match=r"unknown form 'widnow' \(did you mean 'window'\?\)"):
        Rule(form="widnow")
    with pytest.raises(PolicyError, match=r"no parameter 'sink' \(did you mean 'sinks'\?\)"):
        Rule(form="window", params={"window": 8, "sink": 2})


def test_parse_rejects_other_types():
    with pytest.raises(PolicyError, match="preset string"):
        Policy.parse(42)


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("spec", ["exact", "linear:favor+num_features:32", "window:256+sinks:4", "ssm:0.9", "reuse", "hybrid", "auto+tolerance:0.1"])
def test_to_dict_round_trips_presets(spec):
    p = Policy.parse(spec)
    d = p.to_dict()
    assert Policy.parse(d) == p
    assert Policy.parse(json.loads(json.dumps(d))) == p


def test_to_dict_round_trips_filters_and_per_head_decay():
    p = Policy.parse({"name": "mix", "rules": [
        {"layers": "1..-2", "module": "*.attn", "source": ["mha", "sdpa"], "seq_len": [None, 4096], "form": "ssm", "decay": [0.9, 0.95]},
        {"layers": [0, "50%"], "form": "linear", "feature_map": "taylor", "min_seq_len": 256},
    ]})
    again = Policy.parse(json.loads(json.dumps(p.to_dict())))
    assert again == p
    assert again.rules[0].params["decay"] == [0.9, 0.95] and again.rules[1].layers == (0, "50%")
    assert again.rules[1].params["min_seq_len"] == 256


def test_rule_constructed_directly_is_validated():
    r = Rule(form="windowed", params={"window": 8}, layers="2..3")
    assert (r.form, r.layers, r.params["sinks"]) == ("window", (2, 3), 0)
    with pytest.raises(PolicyError, match="sinks"):
        Rule(form="window", params={"sinks": -1})
    assert replace(r, module="a.*").matches(make_site(layer=2, module="a.b"), 4)
