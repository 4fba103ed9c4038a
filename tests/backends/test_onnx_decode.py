"""export_onnx(decode=True): a compiled causal LM generates outside PyTorch exactly as torch generate() does.

The oracle side shares no code with what it checks: `ContractDriver` below generates from a folder
using only onnxruntime, numpy and the contract in the file's metadata (no attnopt import), torch's
side is the compiled model's own `generate()`, and the N×N check is ONNX shape inference. Prompts
and lengths differ from the export's example; batches are left-padded.
"""

import contextlib
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import attnopt

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

from attnopt.ir.errors import ParityError  # noqa: E402

VOCAB, PAD = 89, 0
EXAMPLE = torch.randint(1, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
ALL_FORMS = ["linear", "ssm", "window", "linear+window", "exact"]


# ---------------------------------------------------------------- the oracle: a driver written from the contract


class ContractDriver:
    """Greedy generation from model.onnx knowing only its contract: zeros for every state ("batch" -> B,
    "past_sequence" -> 0, ints as they are), each present fed back as past, the transformers mask
    [B, past + T] and positions cumsum(mask) - 1 (0 at pads), a row that produced eos gets pad."""

    def __init__(self, folder):
        self.sess = ort.InferenceSession(str(Path(folder) / "model.onnx"), providers=["CPUExecutionProvider"])
        meta = json.loads(self.sess.get_modelmeta().custom_metadata_map["attnopt.decode"])
        self.states, self.eos, self.pad = meta["states"], meta["eos_token_id"], meta["pad_token_id"]

    def zeros(self, batch):
        return {s["past"]: np.zeros([batch if d == "batch" else 0 if d == "past_sequence" else d for d in s["shape"]],
                                    dtype=s["dtype"]) for s in self.states}

    def call(self, ids, mask, pos, state):
        out = self.sess.run(["logits"] + [s["present"] for s in self.states],
                            {"input_ids": ids, "attention_mask": mask, "position_ids": pos, **state})
        return out[0], {s["past"]: o for s, o in zip(self.states, out[1:])}

    def greedy(self, ids, mask, new, chunks=(), stop=True):
        ids, mask = np.asarray(ids, np.int64), np.asarray(mask, np.int64)
        B, N = ids.shape
        pos = np.where(mask == 1, np.cumsum(mask, 1) - 1, 0)
        state = self.zeros(B)
        bounds = [0, *chunks, N]
        for a, b in zip(bounds, bounds[1:]):
            logits, state = self.call(ids[:, a:b], mask[:, :b], pos[:, a:b], state)
        seq, steps, sizes, done = ids, [], [], np.zeros(B, bool)
        for _ in range(new):
            steps.append(logits[:, -1])
            token = np.where(done, self.pad, logits[:, -1].argmax(-1))
            seq = np.concatenate([seq, token[:, None]], 1)
            done |= stop & (token == self.eos)
            if done.all():
                break
            mask = np.concatenate([mask, np.ones((B, 1), np.int64)], 1)
            logits, state = self.call(token[:, None], mask, mask.sum(1, keepdims=True) - 1, state)
            sizes.append({s["site"]: 0 for s in self.states})
            for s in self.states:
                sizes[-1][s["site"]] += state[s["past"]].nbytes
        return seq, np.stack(steps, 1), sizes


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def torch_generate(opt, ids, mask, new):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = opt.generate(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), max_new_tokens=new,
                           do_sample=False, pad_token_id=PAD, output_logits=True, return_dict_in_generate=True)
    return out.sequences.numpy(), torch.stack(out.logits, 1).float().numpy()


def left_padded_prompt(n=20, pads=6, seed=7):
    ids = torch.randint(1, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :pads], mask[1, :pads] = PAD, 0
    return ids.numpy(), mask.numpy()


# ---------------------------------------------------------------- models and their folders (one export each)


def decoder(kind, layers, heads=4, kv_heads=2):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                  pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind](**common)
    torch.manual_seed(0)
    return {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[kind](cfg).eval()


def per_layer(forms):
    rules = [{"form": f, "params": {"window": 16, "sinks": 2} if "window" in f else {}, "layers": [i, i]}
             for i, f in enumerate(forms)]
    return {"name": "+".join(forms), "rules": rules}


def compiled(kind, policy, layers, **heads):
    opt = attnopt.compile(decoder(kind, layers, **heads), policy, example_inputs={"input_ids": EXAMPLE},
                          tolerance=10.0, e2e_tolerance=None)  # every site rewritten: what is tested is the export
    return opt


_FOLDERS = {}


def exported(tmp_path_factory, name, kind, policy, layers, target="ort", tokenizer=None, **heads):
    if name not in _FOLDERS:
        opt = compiled(kind, policy, layers, **heads)
        folder = tmp_path_factory.mktemp(name.replace("+", "_").replace(":", "_")) / "out"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = attnopt.export_onnx(opt, folder, {"input_ids": EXAMPLE}, target=target, tokenizer=tokenizer)
        _FOLDERS[name] = (opt, folder, result)
    return _FOLDERS[name]


@pytest.fixture(scope="module")
def every_form(tmp_path_factory):
    """Llama-style (GQA 4/2): linear, ssm, window:16+sinks:2, linear+window:16+sinks:2, exact, one per layer."""
    return exported(tmp_path_factory, "every_form", "llama", per_layer(ALL_FORMS), 5)


@pytest.fixture(scope="module")
def qwen2_mixed(tmp_path_factory):
    return exported(tmp_path_factory, "qwen2_mixed", "qwen2", per_layer(["exact", "window", "linear"]), 3)


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")


@pytest.fixture(scope="module")
def window_sinks(tmp_path_factory):
    """window:16+sinks:2 on every layer, shipped with a tokenizer (genai, the CLI)."""
    return exported(tmp_path_factory, "window_sinks", "llama", "window:16+sinks:2", 2, tokenizer=word_tokenizer())


@pytest.fixture(scope="module")
def linear_ssm_mha(tmp_path_factory):
    """linear then ssm with as many kv heads as query heads: both states [B, 4, 16, 17], one genai shape."""
    return exported(tmp_path_factory, "linear_ssm", "llama", per_layer(["linear", "ssm"]), 2, heads=4, kv_heads=4)


# ---------------------------------------------------------------- tokens and logits against torch generate()


def assert_decodes_like_torch(opt, folder, new=28):
    ids, mask = left_padded_prompt()
    want_seq, want_logits = torch_generate(opt, ids, mask, new)
    assert want_seq.shape[1] - ids.shape[1] >= 16  # the test generates past the 16-key window
    driver = ContractDriver(folder)
    seq, logits, _ = driver.greedy(ids, mask, new)
    assert np.array_equal(seq, want_seq)
    assert max(_rel(logits[:, t], want_logits[:, t]) for t in range(logits.shape[1])) <= 1e-4
    # chunked prefill: a first chunk that is all pads for row 1, then chunks of 3 and 11 tokens
    seq_chunked, logits_chunked, _ = driver.greedy(ids, mask, new, chunks=(6, 9))
    assert np.array_equal(seq_chunked, want_seq) and _rel(logits_chunked, want_logits) <= 1e-4
    from attnopt.onnx import Generator

    assert np.array_equal(Generator(folder).generate(ids, mask, max_new_tokens=new), want_seq)
    return want_seq


def test_every_form_decodes_like_torch_generate(every_form):
    opt, folder, result = every_form
    assert [s["form"] for s in result.sites] == ALL_FORMS
    assert [s["lowering"] for s in result.sites][:2] == ["com.microsoft.LinearAttention"] * 2
    assert result.sites[4]["lowering"] == "com.microsoft.GroupQueryAttention"  # with a pad bias or without
    assert all(p["rel_rms"] <= 1e-4 for p in result.parity) and len(result.parity) == 2
    assert_decodes_like_torch(opt, folder)


def test_qwen2_mixed_exact_window_linear_decodes_like_torch_generate(qwen2_mixed):
    opt, folder, result = qwen2_mixed
    assert [s["form"] for s in result.sites] == ["exact", "window", "linear"]
    assert_decodes_like_torch(opt, folder)


def test_the_contract_in_the_metadata(every_form):
    opt, folder, result = every_form
    meta = json.loads(ort.InferenceSession(str(folder / "model.onnx")).get_modelmeta()
                      .custom_metadata_map["attnopt.decode"])
    by_layer = {s["past"]: s for s in meta["states"]}
    assert by_layer["past_key_values.0.recurrent_state"]["shape"] == ["batch", 2, 16, 17]  # S and z, per kv head
    assert by_layer["past_key_values.2.recurrent_state"]["shape"] == ["batch", 2, 2 + 15, 32]  # S + W - 1 slots
    assert by_layer["past_key_values.2.conv_state"] == {
        "past": "past_key_values.2.conv_state", "present": "present.2.conv_state", "dtype": "int64",
        "shape": ["batch", 1, 1 + 2 + 15], "init": "zeros", "site": "model.layers.2.self_attn#0", "form": "window"}
    assert by_layer["past_key_values.4.key"]["shape"] == ["batch", 2, "past_sequence", 16]
    grows = {s["form"] for s in meta["states"] if "past_sequence" in s["shape"]}
    assert grows == {"exact"} and all(s["init"] == "zeros" for s in meta["states"])
    sess = ort.InferenceSession(str(folder / "model.onnx"))
    assert [i.name for i in sess.get_inputs()][:3] == ["input_ids", "attention_mask", "position_ids"]
    assert [o.name for o in sess.get_outputs()][0] == "logits"
    assert opt.attnopt_report.exports[-1]["state_bytes"]["model.layers.4.self_attn#0"] == {
        "form": "exact", "1024": 2 * 1024 * 32 * 4, "32768": 2 * 32768 * 32 * 4}
    assert result.state_bytes["model.layers.0.self_attn#0"]["1024"] == result.state_bytes[
        "model.layers.0.self_attn#0"]["32768"] == (2 * 16 * 17) * 4 + 8


def test_fixed_size_states_keep_their_bytes_from_16_to_160_new_tokens(every_form):
    opt, folder, _ = every_form
    ids, mask = left_padded_prompt()
    _, _, sizes = ContractDriver(folder).greedy(ids, mask, 161, stop=False)
    for site in sizes[0]:
        if site.startswith("model.layers.4."):  # exact: the K/V cache grows by one column per token
            assert sizes[159][site] > sizes[15][site]
        else:
            assert sizes[15][site] == sizes[159][site], site


# ---------------------------------------------------------------- onnxruntime-genai


@pytest.mark.parametrize("case", ["window_sinks", "linear_ssm_mha"])
def test_genai_generates_the_same_greedy_tokens(case, request):
    og = pytest.importorskip("onnxruntime_genai")
    opt, folder, result = request.getfixturevalue(case)
    assert result.genai["supported"] and result.genai["status"] == "same tokens"
    prompt = left_padded_prompt(n=18, seed=11)[0][:1]  # genai masks no leading pad: one unpadded row
    want, _ = torch_generate(opt, prompt, np.ones_like(prompt), 24)
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=want.shape[1], batch_size=1, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt.astype(np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    assert list(generator.get_sequence(0)) == want[0].tolist()


def test_genai_config_says_why_it_cannot_run_a_model(every_form, qwen2_mixed):
    for _, folder, result in (every_form, qwen2_mixed):
        config = json.loads((folder / "genai_config.json").read_text())
        assert not result.genai["supported"]
        assert config["not_supported_by_onnxruntime_genai"].startswith(result.genai["why"])
    assert "linear_state" in every_form[2].genai["why"]  # linear+window: two fixed tensors per layer
    assert "differ in shape" in qwen2_mixed[2].genai["why"]  # window buffer vs linear state


def test_a_missing_genai_skips_only_the_genai_check(window_sinks, monkeypatch):
    from attnopt.backends.onnx import genai

    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)
    outcome = genai.check(window_sinks[1], [5, 6, 7], [1, 2], 2)
    assert outcome["status"] == "skipped" and "onnxruntime-genai is not installed" in outcome["note"]


# ---------------------------------------------------------------- the runner outside torch, the CLI


def test_the_runner_needs_no_torch(window_sinks):
    opt, folder, _ = window_sinks
    ids, mask = left_padded_prompt(n=12, pads=3, seed=5)
    want, _ = torch_generate(opt, ids, mask, 10)
    code = ("import sys, json, numpy as np\nsys.modules['torch'] = None\n"
            "from attnopt.onnx import Generator\n"
            f"out = Generator({str(folder)!r}, threads=1).generate(np.array({ids.tolist()}), np.array({mask.tolist()}), "
            "max_new_tokens=10)\nprint(json.dumps(out.tolist()))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == want.tolist()


def test_generator_sampling_eos_and_bad_input(window_sinks, tmp_path):
    from attnopt.onnx import Generator

    opt, folder, _ = window_sinks
    gen = Generator(folder)
    ids, mask = left_padded_prompt(n=10, pads=2, seed=9)
    greedy = gen.generate(ids, mask, max_new_tokens=6)
    assert np.array_equal(gen.generate(ids, mask, max_new_tokens=6, do_sample=True, top_k=1, seed=0), greedy)
    a = gen.generate(ids, mask, max_new_tokens=6, do_sample=True, temperature=1.5, top_p=0.9, seed=3)
    assert np.array_equal(a, gen.generate(ids, mask, max_new_tokens=6, do_sample=True, temperature=1.5, top_p=0.9,
                                          seed=3)) and a.shape == (2, 16)
    first = int(greedy[0, 10])  # that row's first new token as eos: it stops there, the other row goes on
    stopped = gen.generate(ids, mask, max_new_tokens=6, eos_token_id=first, pad_token_id=0)
    assert stopped[0, 10] == first and (stopped[0, 11:] == 0).all()
    assert np.array_equal(gen.generate(ids[:1], mask[:1], max_new_tokens=0), ids[:1])
    with pytest.raises(ValueError, match="must match input_ids"):
        gen.generate(ids, mask[:, 1:], max_new_tokens=2)
    with pytest.raises(FileNotFoundError, match="no model.onnx"):
        Generator(tmp_path)


def test_cli_generate_uses_the_folders_tokenizer(window_sinks, capsys):
    typer = pytest.importorskip("typer")
    from attnopt.onnx.cli import generate_command

    opt, folder, _ = window_sinks
    assert (folder / "tokenizer.json").exists()
    app = typer.Typer()
    app.command("generate")(generate_command)
    app.command("other")(lambda: None)
    command = typer.main.get_command(app)
    prompt = "w5 w9 w17 w30 w44"
    ids = np.array([[5, 9, 17, 30, 44]])
    want, _ = torch_generate(opt, ids, np.ones_like(ids), 6)
    assert command.main(["generate", str(folder), "--prompt", prompt, "--max-new-tokens", "6"],
                        standalone_mode=False) == 0
    words = capsys.readouterr().out.strip()
    assert words.split() == prompt.split() + [f"w{t}" for t in want[0, 5:] if t > 2]
    assert command.main(["generate", str(folder.parent)], standalone_mode=False) == 2
    assert capsys.readouterr().err.count("\n") == 1


# ---------------------------------------------------------------- no N×N tensor outside exact sites


def quadratic_tensors(path, decode: bool, N=101):
    """(tensor name, shape) of every tensor with two sequence-length dims, by ONNX shape inference: once on
    the file's symbolic dims, once with the inputs fixed to batch 2, length N (a prefill). Tensors made
    inside an exact site's step are left out (softmax attention is N×N)."""
    model = onnx.load(str(path), load_external_data=False)
    seq = {d.dim_param for i in model.graph.input for j, d in enumerate(i.type.tensor_type.shape.dim)
           if d.dim_param and (("sequence" in d.dim_param) if decode else j == 1)}

    def scan(m, is_seq):
        made, values = set(), []

        def walk(graph, allowed):  # every graph and If branch; what exact-site nodes make is allowed
            values.extend(list(graph.value_info) + list(graph.output))
            for n in graph.node:
                meta = {p.key: p.value for p in n.metadata_props}.get("pkg.torch.onnx.fx_node", "")
                inside = allowed or "exact_step" in meta or "reuse_step" in meta
                for a in n.attribute:
                    if a.type == onnx.AttributeProto.GRAPH:
                        walk(a.g, inside)
                if not inside:
                    made.update(n.output)

        walk(m.graph, False)
        return [(v.name, [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]) for v in values
                if v.name in made and sum(1 for d in v.type.tensor_type.shape.dim if is_seq(d)) >= 2]

    pattern = re.compile(r"\b(" + "|".join(re.escape(s) for s in seq) + r")\b")
    symbolic = scan(onnx.shape_inference.infer_shapes(model), lambda d: bool(d.dim_param and pattern.search(d.dim_param)))
    fixed = onnx.load(str(path), load_external_data=False)
    for i in fixed.graph.input:
        for j, d in enumerate(i.type.tensor_type.shape.dim):
            if d.dim_param:
                d.dim_value = 2 if d.dim_param == "batch" or j == 0 else 0 if d.dim_param == "past_sequence" else N
    del fixed.graph.value_info[:]
    concrete = scan(onnx.shape_inference.infer_shapes(fixed, data_prop=True),
                    lambda d: d.HasField("dim_value") and d.dim_value == N)
    return symbolic + concrete


def test_no_quadratic_tensor_outside_exact_sites(every_form, qwen2_mixed, window_sinks, linear_ssm_mha, tmp_path):
    for _, folder, _ in (every_form, qwen2_mixed, window_sinks, linear_ssm_mha):
        assert quadratic_tensors(folder / "model.onnx", decode=True) == [], folder
    # the oracle sees them: the exact site's scores are N×N
    every = onnx.load(str(every_form[1] / "model.onnx"), load_external_data=False)
    for n in every.graph.node:
        for p in n.metadata_props:
            if p.key == "pkg.torch.onnx.fx_node":
                p.value = p.value.replace("exact_step", "masked")
    onnx.save(every, str(tmp_path / "unmarked.onnx"))
    assert quadratic_tensors(tmp_path / "unmarked.onnx", decode=True)
    # and the prefill file of the rewrite has none either (it used to hold transformers' [B, 1, N, N] mask)
    opt = compiled("llama", per_layer(["linear", "ssm", "window", "linear+window"]), 4)
    ids = EXAMPLE
    attnopt.export_onnx(opt, tmp_path / "prefill.onnx", {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                        baseline=False, check_lengths=[24])
    assert quadratic_tensors(tmp_path / "prefill.onnx", decode=False) == []


# ---------------------------------------------------------------- failures


def test_a_wrong_decode_lowering_names_its_site_and_writes_no_folder(tmp_path, monkeypatch):
    from onnxscript import opset18 as op

    from attnopt.forms.window.onnx import DECODE_LOWERING as WINDOW

    good = WINDOW.by_target["ort"]

    def off_by_a_little(*args, **kwargs):
        out, *states = good(*args, **kwargs)
        return (op.Mul(out, op.CastLike(op.Constant(value_float=1.001), out)), *states)

    monkeypatch.setitem(WINDOW.by_target, "ort", off_by_a_little)
    # after an exact site: its pad rows (which reach nothing) must not be taken for the culprit
    opt = compiled("llama", per_layer(["exact", "window"]), 2)
    with pytest.raises(ParityError) as e:
        attnopt.export_onnx(opt, tmp_path / "bad", {"input_ids": EXAMPLE})
    text = str(e.value)
    assert "\n" not in text and "site model.layers.1.self_attn#0 (window): its ONNX decode step differs" in text
    assert not (tmp_path / "bad").exists() and list(tmp_path.iterdir()) == []


def _one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text, text
    return text


class _Graph(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)


def test_bad_inputs_get_one_line_errors(window_sinks, minilm, tmp_path):
    opt = window_sinks[0]
    with pytest.raises(ValueError) as e:
        attnopt.export_onnx(_Graph(), tmp_path / "g", (torch.randn(1, 2, 8, 16),), decode=True, policy="linear")
    assert "is not a transformers causal LM" in _one_line(e) and "decode=False" in str(e.value)
    with pytest.raises(ValueError) as e:
        attnopt.export_onnx(minilm[0], tmp_path / "m", decode=True, policy="linear")
    assert "BertModel cannot generate" in _one_line(e)
    with pytest.raises(ValueError) as e:
        attnopt.export_onnx(opt, tmp_path / "c", decode=True, target="custom")
    assert "decode=True exports for target 'ort' or 'onnx-std'" in _one_line(e)
    with pytest.raises(ValueError) as e:
        attnopt.export_onnx(opt, tmp_path / "missing" / "out", decode=True)
    assert "does not exist" in _one_line(e)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError) as e:
        attnopt.export_onnx(opt, tmp_path / "file", decode=True)
    assert "it is a file" in _one_line(e)
    assert not any(p.name.startswith(".attnopt") for p in tmp_path.iterdir())


def test_measured_dispatch_thresholds_are_dropped_with_a_one_line_warning(window_sinks, tmp_path):
    import copy

    from attnopt.passes.crossover import Threshold

    opt = copy.deepcopy(window_sinks[0])
    for r in opt.attnopt_report.sites:
        r.threshold = Threshold(r.site.id, "window", 16, "measured", "timed for this test")
        r.outcome.params["min_seq_len"] = 16
    with pytest.warns(UserWarning) as caught, pytest.raises(ValueError):  # a 1-token prompt stops it after
        attnopt.export_onnx(opt, tmp_path / "out", {"input_ids": EXAMPLE[:, :1]})
    message = [str(w.message) for w in caught if "dispatch" in str(w.message)]
    assert message and "\n" not in message[0] and "dropped" in message[0] and "min_seq_len [16]" in message[0]


def test_a_folder_path_decodes_by_default_and_a_file_path_stays_a_prefill_file(window_sinks, tmp_path):
    from attnopt.backends.onnx.decode import DecodeExport, wants_folder

    opt, folder, result = window_sinks
    assert isinstance(result, DecodeExport) and result.folder == str(folder)  # exported with decode=None
    assert sorted(result.files) == sorted(p.name for p in folder.iterdir())
    assert {"model.onnx", "genai_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(result.files)
    assert not wants_folder(opt, tmp_path / "m.onnx") and wants_folder(opt, tmp_path)
    assert not wants_folder(_Graph(), tmp_path)


# ---------------------------------------------------------------- the full matrix


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("policy", ["linear", "ssm", "window:16+sinks:2", "linear+window:16+sinks:2", "mixed",
                                    "reuse"])
def test_each_policy_and_architecture_decodes_like_torch(kind, policy, tmp_path_factory):
    if policy == "mixed":
        policy = per_layer(["exact", "window", "linear"])
    opt, folder, result = exported(tmp_path_factory, f"{kind}-{policy if isinstance(policy, str) else 'mixed'}",
                                   kind, policy, 3)
    assert_decodes_like_torch(opt, folder)
    if policy in ("linear", "ssm", "window:16+sinks:2"):
        assert result.genai["status"] == "same tokens"


@pytest.mark.slow
def test_onnx_std_uses_standard_ops_and_decodes_like_torch(tmp_path_factory):
    opt, folder, result = exported(tmp_path_factory, "every_form_std", "llama", per_layer(ALL_FORMS), 5,
                                   target="onnx-std")
    assert all(s["lowering"] == "standard ops" for s in result.sites)
    assert {n.domain for n in onnx.load(str(folder / "model.onnx")).graph.node} == {""}
    with contextlib.suppress(KeyError):
        assert "com.microsoft.LinearAttention" not in result.ops_after
    assert_decodes_like_torch(opt, folder)
