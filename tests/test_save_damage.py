"""attnopt.load on untrusted directories: every damage is refused in one SaveError line naming the file
and the field, or the directory loads the exact saved model. Damage is done two ways: a plain edit
(the header's own checksum catches it) and a careful one that also rewrites every digest, as a tool
that knows the format would (then the checks of the content itself must catch it)."""

import json
import math
import shutil

import pytest
import torch
from torch import nn

import attnopt
from attnopt.ir.digest import file_digest, json_digest, tensors_digest
from attnopt.ir.errors import SaveError
from attnopt.saving import HEADER_FILE
from attnopt.targets.graph import GraphTarget
from attnopt.targets.hf import SITE_STATE_FILE

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402  (with transformers)

VOCAB = 61


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    policy = {"rules": [{"form": "window", "params": {"window": 8}, "layers": [0, 0]},
                        {"form": "linear+window",
                         "params": {"window": 4, "fit_steps": 5}, "layers": [1, 1]},
                        {"form": "linear", "layers": [2, 2]}]}
    opt = attnopt.compile(model, policy, example_inputs={"input_ids": ids, "use_cache": False}, tolerance=0.99,
                          e2e_tolerance=None, dispatch="off")
    assert [r.outcome.final_form for r in opt.attnopt_report.sites] == ["window", "linear+window", "linear"]
    path = attnopt.save(opt, tmp_path_factory.mktemp("saved") / "llama")
    with torch.no_grad():
        logits = opt(input_ids=ids, use_cache=False).logits
    return path, ids, logits


@pytest.fixture
def copy_of(saved_llama, tmp_path):
    src = saved_llama[0]
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def _header(path):
    return json.loads((path / HEADER_FILE).read_text())


def _write(path, header, *, reseal=True):
    """Write the header back; `reseal` recomputes every digest, as a careful tool would."""
    if reseal:
        header["files"] = {n: file_digest(path / n) for n in header["files"]}
        header["checksum"] = json_digest({k: v for k, v in header.items() if k != "checksum"})
    (path / HEADER_FILE).write_text(json.dumps(header))


def _refused(path, *words):
    with pytest.raises(SaveError) as e:
        attnopt.load(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("attnopt.load: "), msg
    for w in words:
        assert w in msg, msg
    return msg


def _window_entry(header):
    return next(s for s in header["sites"] if s["form"] == "window")


def test_an_untouched_directory_loads_the_exact_saved_model(saved_llama, copy_of):
    _, ids, logits = saved_llama
    (copy_of / "NOTES.txt").write_text("a file the user added")  # unlisted files are ignored
    model = attnopt.load(copy_of)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, logits)
    header = _header(copy_of)
    assert header["format_version"] == 3 and len(header["checksum"]) == 64
    assert {"model.safetensors", "config.json", SITE_STATE_FILE} <= set(header["files"])
    assert all(len(s["sha256"]) == 64 for s in header["sites"])


def test_an_edited_header_is_refused_by_its_checksum(copy_of):
    header = _header(copy_of)
    _window_entry(header)["params"]["window"] = 64
    _write(copy_of, header, reseal=False)
    _refused(copy_of, "attnopt.json", "edited after attnopt.save")


def test_a_deleted_site_entry_is_refused_even_with_the_digests_rewritten(copy_of):
    header = _header(copy_of)
    header["sites"] = [s for s in header["sites"] if s["form"] != "window"]
    _write(copy_of, header)
    _refused(copy_of, "model.layers.0.self_attn#0", "no site module", "window")


def test_a_window_edited_from_8_to_64_is_refused_against_the_report(copy_of):
    header = _header(copy_of)
    _window_entry(header)["params"]["window"] = 64
    _write(copy_of, header)
    _refused(copy_of, "model.layers.0.self_attn#0", "'window': 64", "'window': 8")


def test_a_window_given_as_a_string_is_one_line(copy_of):
    header = _header(copy_of)
    _window_entry(header)["params"]["window"] = "8"
    _write(copy_of, header)
    _refused(copy_of, "sites.model.layers.0.self_attn#0.params", "window")


@pytest.mark.parametrize("dtypes", [{"model.rotary_emb.inv_freq": "torch.int64"}, {"model.nothing.here": "torch.float32"},
                                    {"model.embed_tokens.weight": "torch.float32"}, ["model.rotary_emb.inv_freq"]])
def test_a_damaged_buffer_dtype_record_is_refused(copy_of, dtypes):
    header = _header(copy_of)
    assert header["buffer_dtypes"]["model.rotary_emb.inv_freq"] == "torch.float32"
    header["buffer_dtypes"] = dtypes
    _write(copy_of, header)
    _refused(copy_of, "buffer_dtypes", "damaged")


def test_a_form_whose_parameters_changed_is_refused(copy_of):
    header = _header(copy_of)
    linear = next(s for s in header["sites"] if s["form"] == "linear")
    del linear["params"]["num_features"]
    _write(copy_of, header)
    _refused(copy_of, "model.layers.2.self_attn#0", "params")


@pytest.mark.parametrize("version, words", [(0, ["format 0", "does not read"]), (1, ["format 1", "save it again"]),
                                            (2, ["format 2", "pickle", "compile the model again"]),
                                            (99, ["format 99", "upgrade"]), ("3", ["no integer format_version"])])
def test_unknown_and_old_format_versions_are_refused(copy_of, version, words):
    header = _header(copy_of)
    header["format_version"] = version
    _write(copy_of, header)
    _refused(copy_of, *words)


@pytest.mark.parametrize("field", ["report", "files", "checksum", "policy", "sites", "versions"])
def test_a_missing_header_field_is_named(copy_of, field):
    header = _header(copy_of)
    del header[field]
    _write(copy_of, header, reseal=field not in ("files", "checksum"))
    _refused(copy_of, field if field != "versions" else "versions")


def test_a_truncated_tensor_file_is_refused(copy_of):
    file = copy_of / SITE_STATE_FILE
    file.write_bytes(file.read_bytes()[:-40])
    _refused(copy_of, SITE_STATE_FILE, "changed after attnopt.save")
    _write(copy_of, _header(copy_of))  # digests rewritten: the file itself is then unreadable
    _refused(copy_of, SITE_STATE_FILE, "cannot be read")


def test_site_tensors_of_another_shape_or_value_are_refused(copy_of):
    file = copy_of / SITE_STATE_FILE
    state = load_file(str(file))
    name = next(k for k in state if k.startswith("model.layers.1"))
    bigger = dict(state, **{name: torch.cat([state[name], state[name]])})
    save_file(bigger, str(file))
    _write(copy_of, _header(copy_of))
    _refused(copy_of, SITE_STATE_FILE, "model.layers.1.self_attn#0", "declared")
    nudged = dict(state, **{name: state[name] + 1e-3})
    save_file(nudged, str(file))
    _write(copy_of, _header(copy_of))
    _refused(copy_of, SITE_STATE_FILE, "sha256 differs")


def test_damaged_model_weights_are_refused(copy_of):
    weights = copy_of / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    _refused(copy_of, "model.safetensors", "changed after attnopt.save")
    _write(copy_of, _header(copy_of))
    _refused(copy_of, "model.safetensors", "cannot be read as safetensors")


def test_a_missing_file_is_refused(copy_of):
    (copy_of / SITE_STATE_FILE).unlink()
    _refused(copy_of, SITE_STATE_FILE, "missing")


def test_a_report_edited_to_match_nothing_is_refused(copy_of):
    header = _header(copy_of)
    for record in header["report"]["sites"]:
        if record["outcome"]["final_form"] == "linear":
            record["outcome"]["final_form"] = "ssm"
    _write(copy_of, header)
    _refused(copy_of, "model.layers.2.self_attn#0", "linear", "ssm")


def test_the_digests_are_independent_oracles():
    """The digests used above change with any byte of a tensor or key of a header (so a test that
    rewrites them can only pass if the content checks, not the digests, refuse the damage)."""
    t = {"a": torch.arange(6.0).reshape(2, 3)}
    assert tensors_digest(t) != tensors_digest({"a": t["a"].reshape(3, 2)})
    assert tensors_digest(t) != tensors_digest({"a": t["a"].to(torch.float64)})
    assert tensors_digest(t) == tensors_digest({"a": t["a"].clone()})
    assert json_digest({"x": 1, "y": [1, 2]}) == json_digest({"y": [1, 2], "x": 1}) != json_digest({"x": 1.5})


# ---------------------------------------------------------------- graph path

C, H = 16, 2


class TinyAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, C // H).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(C // H)
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, C)


@pytest.fixture
def saved_graph(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 20, C)
    opt = attnopt.compile(TinyAttention().eval(), "window:4", example_inputs=(x,), tolerance=0.99,
                          e2e_tolerance=None, dispatch="off")
    return attnopt.save(opt, tmp_path / "graph"), opt, x


def test_a_graph_directory_loads_exactly_or_not_at_all(saved_graph):
    path, opt, x = saved_graph
    with torch.no_grad():
        assert torch.equal(attnopt.load(path)(x), opt(x))
    program = path / GraphTarget.PROGRAM_FILE
    program.write_bytes(program.read_bytes()[:-100])
    _refused(path, GraphTarget.PROGRAM_FILE, "changed after attnopt.save")
    _write(path, _header(path))
    _refused(path, GraphTarget.PROGRAM_FILE, "not a torch.export archive")


def test_a_graph_report_that_disagrees_with_the_site_modules_is_refused(saved_graph):
    path, _, _ = saved_graph
    header = _header(path)
    header["report"]["sites"][0]["outcome"]["params"]["window"] = 5
    _write(path, header)
    _refused(path, "runs window", "'window': 4", "'window': 5")


def test_graph_site_tensors_of_another_value_are_refused(tmp_path):
    """A stateful graph site (FAVOR+'s projection): its tensors nudged, digests rewritten."""
    torch.manual_seed(0)
    x = torch.randn(2, 20, C)
    opt = attnopt.compile(TinyAttention().eval(), "linear:favor", example_inputs=(x,), tolerance=0.99,
                          e2e_tolerance=None, dispatch="off")
    path = attnopt.save(opt, tmp_path / "favor")
    file = path / GraphTarget.SITE_STATE_FILE
    state = load_file(str(file))
    assert list(state) == ["graph#0/feature_map.omega_DM"]
    save_file({k: v + 1e-3 for k, v in state.items()}, str(file))
    _write(path, _header(path))
    _refused(path, GraphTarget.SITE_STATE_FILE, "graph#0", "sha256 differs")
