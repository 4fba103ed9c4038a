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


# Layer 1 reads layer 0's selection, in blocks of 2 (4 read per query): it selects within the checks' prompts.
REUSE = "reuse:1+block:2+anchor:-1+window:0+sinks:0"


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
    """Qwen2 (GQA 4/2, q/k/v biases): exact, window:16+sinks:2, linear, ssm, one per layer."""
    return exported(tmp_path_factory, "qwen2_mixed", "qwen2", per_layer(["exact", "window", "linear", "ssm"]), 4)


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


def test_qwen2_mixed_exact_window_linear_ssm_decodes_like_torch_generate(qwen2_mixed):
    opt, folder, result = qwen2_mixed
    assert [s["form"] for s in result.sites] == ["exact", "window", "linear", "ssm"]
    assert_decodes_like_torch(opt, folder)


def test_the_contract_in_the_metadata(every_form):
    """Five forms, so the fixed-size layers travel packed (one pair of one shape each, for onnxruntime-genai);
    the contract says where each of a site's own states lies in its pair."""
    opt, folder, result = every_form
    meta = json.loads(ort.InferenceSession(str(folder / "model.onnx")).get_modelmeta()
                      .custom_metadata_map["attnopt.decode"])
    by_layer = {s["past"]: s for s in meta["states"]}
    packs = {(s["past"], p["state"]): (p["shape"], p["offset"]) for s in meta["states"] for p in s.get("packs", [])}
    # linear: S ‖ z per kv head, and its real-token count
    assert packs[("past_key_values.0.recurrent_state", "recurrent_state")] == (["batch", 2, 16, 17], 0)
    assert packs[("past_key_values.0.conv_state", "conv_state")] == (["batch", 1, 1], 0)
    assert packs[("past_key_values.2.recurrent_state", "recurrent_state")] == (["batch", 2, 2 + 15, 32], 0)  # S + W - 1
    assert packs[("past_key_values.3.recurrent_state", "linear_state")] == (["batch", 4, 32, 17], 2 * 17 * 32)
    assert by_layer["past_key_values.2.conv_state"] == {
        "past": "past_key_values.2.conv_state", "present": "present.2.conv_state", "dtype": "int64",
        "shape": ["batch", 1, 18], "init": "zeros", "site": "model.layers.2.self_attn#0", "form": "window",
        "packs": [{"state": "conv_state", "shape": ["batch", 1, 1 + 2 + 15], "offset": 0}]}
    pairs = {tuple(s["shape"]) for s in meta["states"] if s["past"].split(".")[-1] in ("recurrent_state", "conv_state")}
    assert pairs == {("batch", 1, 1, 2 * 17 * 32 + 4 * 32 * 17), ("batch", 1, 18)}  # one shape per pair: the largest
    assert by_layer["past_key_values.4.key"]["shape"] == ["batch", 2, "past_sequence", 16]
    grows = {s["form"] for s in meta["states"] if "past_sequence" in s["shape"]}
    assert grows == {"exact"} and all(s["init"] == "zeros" for s in meta["states"])
    sess = ort.InferenceSession(str(folder / "model.onnx"))
    assert [i.name for i in sess.get_inputs()][:3] == ["input_ids", "attention_mask", "position_ids"]
    assert [o.name for o in sess.get_outputs()][0] == "logits"
    assert opt.attnopt_report.exports[-1]["state_bytes"]["model.layers.4.self_attn#0"] == {
        "form": "exact", "1024": 2 * 1024 * 32 * 4, "32768": 2 * 32768 * 32 * 4}
    page = opt.attnopt_report.to_html()
    assert str(folder) in page[page.index("<h2>ONNX exports</h2>"):] and "decode folder" in page
    assert result.state_bytes["model.layers.0.self_attn#0"]["1024"] == result.state_bytes[
        "model.layers.0.self_attn#0"]["32768"] == (2 * 17 * 32 + 4 * 32 * 17) * 4 + 18 * 8  # its pair, padding and all


def test_a_natural_layout_when_genai_takes_it(window_sinks, linear_ssm_mha):
    """Layers whose own states are already one pair of one shape keep them as they are."""
    for _, _, result in (window_sinks, linear_ssm_mha):
        assert all("packs" not in s for s in result.contract["states"])
    shapes = {s["past"]: s["shape"] for s in linear_ssm_mha[2].contract["states"]}
    assert shapes["past_key_values.0.recurrent_state"] == shapes["past_key_values.1.recurrent_state"] == [
        "batch", 4, 16, 17]


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


def genai_greedy(folder, prompt_row, max_length):
    """onnxruntime_genai's own greedy loop over the folder (batch 1: genai masks no leading pad)."""
    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max_length, batch_size=1, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray([prompt_row], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return list(generator.get_sequence(0))


def assert_genai_generates_like_torch(opt, folder, result, n=18, new=24):
    """genai's tokens are torch's, both stopping at the model's eos (genai leaves the eos out), on the first
    prompt (seeds 11, 12, ...) after which torch makes 8 tokens or more before its eos."""
    assert result.genai["supported"] and result.genai["status"] == "same tokens", result.genai
    for seed in range(11, 21):
        prompt = left_padded_prompt(n=n, seed=seed)[0][:1]
        want, _ = torch_generate(opt, prompt, np.ones_like(prompt), new)
        if want.shape[1] - n >= 8 + 1:
            break
    got = genai_greedy(folder, prompt[0], want.shape[1])
    assert got == want[0, :len(got)].tolist() and len(got) - n >= 8
    assert len(got) == want.shape[1] or want[0, len(got)] == opt.generation_config.eos_token_id


@pytest.mark.parametrize("case", ["window_sinks", "linear_ssm_mha", "every_form", "qwen2_mixed"])
def test_genai_generates_the_same_greedy_tokens(case, request):
    """Natural pairs (window_sinks, linear_ssm_mha) and packed ones: five forms beside an exact K/V cache
    (every_form), and exact, window, linear, ssm on Qwen2 (pairs of different shapes until packed)."""
    opt, folder, result = request.getfixturevalue(case)
    assert (folder / "genai_config.json").exists()
    assert_genai_generates_like_torch(opt, folder, result)


@pytest.mark.slow
def test_a_folder_genai_cannot_run_gets_one_warning_and_no_genai_config(tmp_path):
    """reuse keeps its selection state besides K/V, which no packing holds: said once at export, no config written
    (og.Model would load one and fail at its first step), and the folder still generates with Generator."""
    from attnopt.onnx import Generator

    opt = compiled("llama", REUSE, 3)
    with pytest.warns(UserWarning) as caught:
        result = attnopt.export_onnx(opt, tmp_path / "out", {"input_ids": EXAMPLE})
    said = [str(w.message) for w in caught if "onnxruntime-genai" in str(w.message)]
    assert len(said) == 1 and "\n" not in said[0] and "probe_queries" in said[0] and "no genai_config.json" in said[0]
    assert not result.genai["supported"] and not (tmp_path / "out" / "genai_config.json").exists()
    ids, mask = left_padded_prompt(n=12, pads=3, seed=4)
    want, _ = torch_generate(opt, ids, mask, 8)
    assert np.array_equal(Generator(tmp_path / "out").generate(ids, mask, max_new_tokens=8), want)


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
    # The default is the model's own eos (2 here), None never stops early: 30 steps of a random model
    never = gen.generate(ids, mask, max_new_tokens=30, eos_token_id=None)
    assert never.shape == (2, 40) and (never[:, 10:] == 2).any()  # ... which does say "2" on the way
    stops = gen.generate(ids, mask, max_new_tokens=30)
    assert np.array_equal(stops, torch_generate(opt, ids, mask, 30)[0]) and not np.array_equal(stops, never)
    with pytest.raises(ValueError, match="eos_token_id must be 'model'"):
        gen.generate(ids, mask, max_new_tokens=2, eos_token_id="none")
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
    junk = folder.parent / "junk"  # a folder whose model.onnx is no ONNX model: ORT's error, in one line
    junk.mkdir(exist_ok=True)
    (junk / "model.onnx").write_text("not a model")
    assert command.main(["generate", str(junk), "--prompt", prompt], standalone_mode=False) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ONNX Runtime cannot load it" in err
    # --ignore-eos: all 30 new tokens, as Generator's eos_token_id=None (special tokens are not printed)
    from attnopt.onnx import Generator

    never = Generator(folder).generate(ids, max_new_tokens=30, eos_token_id=None)
    assert command.main(["generate", str(folder), "--prompt", prompt, "--max-new-tokens", "30", "--ignore-eos"],
                        standalone_mode=False) == 0
    assert capsys.readouterr().out.split() == prompt.split() + [f"w{t}" for t in never[0, 5:] if t > 2]


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
    with pytest.warns(UserWarning, match="prefill.onnx is one prefill file .* to generate, export a folder") as said:
        attnopt.export_onnx(opt, tmp_path / "prefill.onnx", {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                            baseline=False, check_lengths=[24])
    assert sum("prefill file" in str(w.message) for w in said) == 1
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


def test_measured_dispatch_thresholds_are_kept_as_an_exact_prefix(tmp_path):
    """A measured min_seq_len (the automatic dispatch's) is exported as the compiled model runs it: exact
    attention for each row's first T real tokens, then the form; the export's check crosses T."""
    import copy

    from attnopt.passes.crossover import Threshold

    opt = copy.deepcopy(compiled("llama", "window:16+sinks:2", 2))
    for r in opt.attnopt_report.sites:
        r.threshold = Threshold(r.site.id, "window", 20, "measured", "timed for this test")
        r.outcome.params["min_seq_len"] = 20
    for m in opt.modules():
        if getattr(m, "form", None) == "window":
            m.min_seq_len = m.params["min_seq_len"] = 20
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is dropped, nothing to warn about
        result = attnopt.export_onnx(opt, tmp_path / "out", {"input_ids": EXAMPLE})
    assert [s["exact_below"] for s in result.sites] == [20, 20] and result.dispatch_dropped == {}
    assert result.parity[0]["length"] == 22  # the check's prompt: T + 2, row 1 with 4 pads
    prefixes = [p["shape"] for s in result.contract["states"] for p in s.get("packs", [])
                if p["state"] == "exact_prefix"]
    assert prefixes == [["batch", 2, 20, 32]] * 2
    ids, mask = left_padded_prompt(n=12, pads=3, seed=4)  # row 0 passes 20 real tokens at step 9, row 1 at 12
    want, want_logits = torch_generate(opt, ids, mask, 24)
    seq, logits, _ = ContractDriver(tmp_path / "out").greedy(ids, mask, 24)
    assert np.array_equal(seq, want) and _rel(logits, want_logits) <= 1e-4
    assert_genai_generates_like_torch(opt, tmp_path / "out", result, n=16)


def test_a_folder_path_decodes_by_default_and_a_file_path_stays_a_prefill_file(window_sinks, tmp_path):
    from attnopt.backends.onnx.decode import DecodeExport, wants_folder

    opt, folder, result = window_sinks
    assert isinstance(result, DecodeExport) and result.folder == str(folder)  # exported with decode=None
    assert sorted(result.files) == sorted(p.name for p in folder.iterdir())
    assert {"model.onnx", "genai_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(result.files)
    assert not wants_folder(opt, tmp_path / "m.onnx") and wants_folder(opt, tmp_path)
    assert not wants_folder(_Graph(), tmp_path)


# ---------------------------------------------------------------- the full matrix


# Llama runs every form in one model (every_form) and Qwen2 exact, window, linear and ssm (qwen2_mixed):
# here Qwen2 gets linear+window on every layer, and reuse (which reads an exact anchor) runs on both
# (Llama's with an exact prefix below 20 positions; its plain reuse export generates in
# test_a_folder_genai_cannot_run_gets_one_warning_and_no_genai_config).
@pytest.mark.slow
@pytest.mark.parametrize("kind, policy", [("qwen2", "linear+window:16+sinks:2"), ("qwen2", REUSE),
                                          ("llama", REUSE + "+min_seq_len:20")])
def test_each_policy_and_architecture_decodes_like_torch(kind, policy, tmp_path_factory):
    opt, folder, result = exported(tmp_path_factory, f"{kind}-{policy}", kind, policy, 3)
    assert_decodes_like_torch(opt, folder)


@pytest.mark.slow
def test_onnx_std_uses_standard_ops_and_decodes_like_torch(tmp_path_factory):
    opt, folder, result = exported(tmp_path_factory, "every_form_std", "llama", per_layer(ALL_FORMS), 5,
                                   target="onnx-std")
    assert all(s["lowering"] == "standard ops" for s in result.sites)
    assert {n.domain for n in onnx.load(str(folder / "model.onnx")).graph.node} == {""}
    with contextlib.suppress(KeyError):
        assert "com.microsoft.LinearAttention" not in result.ops_after
    assert_decodes_like_torch(opt, folder)
