"""attnopt.load on a directory an attacker prepared: a pickle whose __reduce__ writes a marker file is
put in every file of a saved directory (both mechanisms), in every member of the graph path's
torch.export archive, and code in every field of it that torch.export.load or
ExportedProgram.module() would eval or exec; every digest is then recomputed as attnopt/ir/digest.py
computes it. Each load is refused in one line, and the marker never appears."""

import io
import json
import math
import pickle
import shutil
import zipfile

import pytest
import torch
from torch import nn

import attnopt
from attnopt.ir.digest import file_digest, json_digest
from attnopt.ir.errors import SaveError
from attnopt.saving import HEADER_FILE
from attnopt.targets.graph import GraphTarget
from attnopt.targets.hf import SITE_STATE_FILE

transformers = pytest.importorskip("transformers")

C, H = 16, 2


class Payload:
    """Unpickled, it writes `marker`: what the reviewer's pickle did with a shell command."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('the payload ran')",)


def _pickled(marker) -> bytes:
    return pickle.dumps(Payload(marker))


def _torch_pickled(marker) -> bytes:
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    return buffer.getvalue()


PAYLOADS = {"pickle": _pickled, "torch.save": _torch_pickled}


def _code(marker) -> str:
    """A Python expression that writes `marker` when evaluated."""
    return f"exec({Payload(marker).__reduce__()[1][0]!r})"


def _reseal(path):
    """Recompute every digest of the header, exactly as attnopt.save computes them (ir/digest.py)."""
    header = json.loads((path / HEADER_FILE).read_text())
    header["files"] = {n: file_digest(path / n) for n in header["files"]}
    header["checksum"] = json_digest({k: v for k, v in header.items() if k != "checksum"})
    (path / HEADER_FILE).write_text(json.dumps(header))


def _list_file(path, name, data):
    """Add a file to the directory and to the header's list of files."""
    (path / name).write_bytes(data)
    header = json.loads((path / HEADER_FILE).read_text())
    header["files"][name] = ""
    (path / HEADER_FILE).write_text(json.dumps(header))


def _refused(path, marker, *words):
    with pytest.raises(SaveError) as e:
        attnopt.load(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("attnopt.load: "), msg
    for w in words:
        assert w in msg, msg
    assert not marker.exists(), "the payload ran"
    return msg


# ---------------------------------------------------------------- graph path


class TinyAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, C // H).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(C // H)
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, C)


@pytest.fixture(scope="module")
def saved_graph(tmp_path_factory):
    torch.manual_seed(0)
    x = torch.randn(2, 20, C)
    # FAVOR+: a site module with tensors of its own, so attnopt_sites.safetensors is not empty.
    opt = attnopt.compile(TinyAttention().eval(), "linear:favor", example_inputs=(x,), tolerance=0.99,
                          e2e_tolerance=None, dispatch="off")
    return attnopt.save(opt, tmp_path_factory.mktemp("saved") / "graph"), opt, x


@pytest.fixture
def graph_copy(saved_graph, tmp_path):
    return shutil.copytree(saved_graph[0], tmp_path / "copy"), tmp_path / "marker"


def _archive_members(file) -> tuple:
    """(root, {member: bytes}) of a torch.export archive, members named relative to its root."""
    with zipfile.ZipFile(file) as z:
        infos = z.infolist()
        root = infos[0].filename.split("/", 1)[0]
        return root, {i.filename.split("/", 1)[1]: z.read(i) for i in infos}


def _edit_archive(path, edit):
    """Rewrite the directory's program archive with `edit(members)` applied, then reseal the header."""
    file = path / GraphTarget.PROGRAM_FILE
    root, members = _archive_members(file)
    edit(members)
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(f"{root}/{name}", data)
    _reseal(path)


def _edit_json(members, name, edit):
    value = json.loads(members[name])
    edit(value)
    members[name] = json.dumps(value).encode()


def test_the_untouched_graph_directory_loads(saved_graph, tmp_path):
    """The control: the same directory, resealed without a change, loads and computes the saved model."""
    path, opt, x = saved_graph
    copy = shutil.copytree(path, tmp_path / "copy")
    _edit_archive(copy, lambda members: None)
    with torch.no_grad():
        assert torch.equal(attnopt.load(copy)(x), opt(x))


@pytest.mark.parametrize("how", list(PAYLOADS))
@pytest.mark.parametrize("slot, words", [
    (GraphTarget.PROGRAM_FILE, [GraphTarget.PROGRAM_FILE]),  # torch.save's zip: "holds the member 'data.pkl'"
    (GraphTarget.SITE_STATE_FILE, ["cannot be read"]),
    (HEADER_FILE, ["cannot be read as JSON"]),
    ("attnopt_graph.pt", ["lists 'attnopt_graph.pt'"]),  # format 2's pickle, listed in a format-3 header
])
def test_a_pickle_in_any_file_of_a_graph_directory_never_runs(graph_copy, slot, words, how):
    path, marker = graph_copy
    if slot == "attnopt_graph.pt":
        _list_file(path, slot, PAYLOADS[how](marker))
    else:
        (path / slot).write_bytes(PAYLOADS[how](marker))
    if slot != HEADER_FILE:
        _reseal(path)
    _refused(path, marker, *words)


def test_a_format_2_directory_is_refused_without_reading_its_pickle(graph_copy):
    path, marker = graph_copy
    _list_file(path, "attnopt_graph.pt", _torch_pickled(marker))
    header = json.loads((path / HEADER_FILE).read_text())
    header["format_version"] = 2
    (path / HEADER_FILE).write_text(json.dumps(header))
    _reseal(path)
    _refused(path, marker, "format 2", "compile the model again", "attnopt.save")


def test_a_pickle_in_any_member_of_the_program_archive_never_runs(saved_graph, tmp_path):
    _, members = _archive_members(saved_graph[0] / GraphTarget.PROGRAM_FILE)
    assert len(members) >= 10 and "data/sample_inputs/model.pt" in members
    for i, name in enumerate(sorted(members)):
        path, marker = shutil.copytree(saved_graph[0], tmp_path / f"copy{i}"), tmp_path / f"marker{i}"
        payload = _pickled(marker)
        if len(payload) == len(members[name]):  # a tensor payload of its exact length would be read as numbers
            payload += b"."
        _edit_archive(path, lambda m: m.__setitem__(name, payload))
        _refused(path, marker, GraphTarget.PROGRAM_FILE)


def _pickled_weight(members, marker):
    _edit_json(members, "data/weights/model_weights_config.json",
               lambda c: next(iter(c["config"].values())).update(use_pickle=True))
    members["data/weights/weight_0"] = _torch_pickled(marker)


def _constant_object(prefix):
    def edit(members, marker):
        _edit_json(members, "data/constants/model_constants_config.json", lambda c: c["config"].update(
            obj={"path_name": f"{prefix}0", "is_param": False, "use_pickle": True, "tensor_meta": None}))
        members[f"data/constants/{prefix}0"] = _pickled(marker)
    return edit


@pytest.mark.parametrize("edit, words", [
    # torch.export.load would torch.load(weights_only=False) it
    (_pickled_weight, ["is not a plain tensor"]),
    # ... pickle.loads / torch._C._pickle_load_obj it
    (_constant_object("opaque_obj_"), ["'data/constants/opaque_obj_0'"]),
    (_constant_object("custom_obj_"), ["'data/constants/custom_obj_0'"]),
    # ... torch.load it, falling back to weights_only=False when the safe load fails
    (lambda m, marker: m.__setitem__("data/sample_inputs/model.pt", _torch_pickled(marker)), ["sample inputs"]),
    (lambda m, marker: m.__setitem__("data/weights/model.pt", _torch_pickled(marker)), ["'data/weights/model.pt'"]),
    (lambda m, marker: m.__setitem__("data/constants/model.pt", _torch_pickled(marker)), ["'data/constants/model.pt'"]),
    # ... load a native library from it
    (lambda m, marker: m.__setitem__("data/aotinductor/model/model.so", b"\x7fELF"), ["native code"]),
], ids=["pickled weight", "opaque object", "custom object", "sample inputs", "legacy weights", "legacy constants",
        "aoti library"])
def test_archive_members_torch_would_unpickle_or_load_are_refused(graph_copy, edit, words):
    path, marker = graph_copy
    _edit_archive(path, lambda members: edit(members, marker))
    _refused(path, marker, GraphTarget.PROGRAM_FILE, *words)


def _first(items, test):
    return next(item for item in items if test(item))


def _node(program):
    return program["graph_module"]["graph"]["nodes"][0]


def _set_expr(program, code):
    # Still a symbol once evaluated: unchecked, torch.export.load runs the code and loads the program.
    values = program["graph_module"]["graph"]["tensor_values"]
    size = _first((s for v in values.values() for s in v["sizes"]), lambda s: "as_expr" in s)
    size["as_expr"]["expr_str"] = f"{code} or {size['as_expr']['expr_str']}"


def _set_target(program, code, target="torch.os.system"):
    node = _node(program)
    node["target"] = target
    node["inputs"] = [{"name": "command", "arg": {"as_string": code}, "kind": 1}]


def _set_parameter_name(program, code):
    spec = _first(program["graph_module"]["signature"]["input_specs"], lambda s: "parameter" in s)
    spec["parameter"]["parameter_name"] = f'qkv.w")or {code} or("'


def _set_forward_names(program, code):
    call = program["graph_module"]["module_call_graph"][0]["signature"]
    call["forward_arg_names"] = [f"x={code}"]


def _set_kwargs_key(program, code):
    call = program["graph_module"]["module_call_graph"][0]["signature"]
    spec = json.loads(call["in_spec"])
    spec[1]["children_spec"][1]["context"] = json.dumps([f"x':{code},'y"])
    call["in_spec"] = json.dumps(spec)


@pytest.mark.parametrize("edit, words", [
    # sympy.sympify evals a symbolic size's text
    (_set_expr, ["symbolic size"]),
    # ExportedProgram.module() execs guards_code
    (lambda p, code: p.update(guards_code=[f"{code} is None"]), ["guards_code"]),
    # the node's target resolves by attribute walk from torch; the graph calls it when it runs
    (_set_target, ["'torch.os.system'"]),
    (lambda p, code: _set_target(p, code, "torch.ops.higher_order.run_const_graph"), ["higher-order op"]),
    # FX pastes these into the forward it generates and execs
    (_set_parameter_name, ["quote"]),
    (_set_forward_names, ["not a Python identifier"]),
    (_set_kwargs_key, ["quote"]),
    # torch.export.load unpickles custom objects' constants
    (lambda p, code: p["graph_module"]["graph"].update(custom_obj_values={"obj": {"class_fqn": code}}),
     ["custom object"]),
], ids=["symbolic size", "guards code", "node target", "higher-order op", "parameter path", "forward argument",
        "kwargs key", "custom object"])
def test_code_in_the_serialized_program_is_refused(graph_copy, edit, words):
    path, marker = graph_copy
    _edit_archive(path, lambda m: _edit_json(m, "models/model.json", lambda p: edit(p, _code(marker))))
    _refused(path, marker, "models/model.json", *words)


def test_a_successful_load_never_unpickles(saved_graph, saved_llama, monkeypatch):
    """Both mechanisms load with every unpickler in reach made to fail the test."""
    def unpickle(*args, **kwargs):
        raise AssertionError("attnopt.load unpickled something")

    for owner, name in ((torch, "load"), (pickle, "load"), (pickle, "loads"), (torch._C, "_pickle_load_obj")):
        monkeypatch.setattr(owner, name, unpickle)
    path, opt, x = saved_graph
    with torch.no_grad():
        assert torch.equal(attnopt.load(path)(x), opt(x))
    path, ids, logits = saved_llama
    with torch.no_grad():
        assert torch.equal(attnopt.load(path)(input_ids=ids, use_cache=False).logits, logits)


# ---------------------------------------------------------------- transformers mechanism

VOCAB = 61


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    opt = attnopt.compile(transformers.LlamaForCausalLM(cfg).eval(), "linear:favor",
                          example_inputs={"input_ids": ids, "use_cache": False}, tolerance=0.99, e2e_tolerance=None,
                          dispatch="off")
    path = attnopt.save(opt, tmp_path_factory.mktemp("saved") / "llama")
    with torch.no_grad():
        logits = opt(input_ids=ids, use_cache=False).logits
    return path, ids, logits


@pytest.fixture
def llama_copy(saved_llama, tmp_path):
    return shutil.copytree(saved_llama[0], tmp_path / "copy"), tmp_path / "marker"


def test_the_saved_transformers_directory_holds_the_files_the_slots_below_cover(saved_llama):
    files = json.loads((saved_llama[0] / HEADER_FILE).read_text())["files"]
    assert sorted(files) == sorted(["config.json", "generation_config.json", "model.safetensors", SITE_STATE_FILE])


@pytest.mark.parametrize("how", list(PAYLOADS))
@pytest.mark.parametrize("slot, words", [
    ("config.json", ["config.json", "JSON"]),
    ("generation_config.json", ["generation_config.json", "JSON"]),
    ("model.safetensors", ["model.safetensors", "safetensors"]),
    (SITE_STATE_FILE, [SITE_STATE_FILE, "cannot be read"]),
    (HEADER_FILE, ["cannot be read as JSON"]),
    # files transformers would unpickle or import if they sat beside the model's, listed in the header
    ("pytorch_model.bin", ["lists 'pytorch_model.bin'"]),
    ("adapter_model.bin", ["lists 'adapter_model.bin'"]),
    ("modeling_llama.py", ["lists 'modeling_llama.py'"]),
])
def test_a_pickle_in_any_file_of_a_transformers_directory_never_runs(llama_copy, slot, words, how):
    path, marker = llama_copy
    if (path / slot).exists():
        (path / slot).write_bytes(PAYLOADS[how](marker))
    else:
        _list_file(path, slot, PAYLOADS[how](marker))
    if slot != HEADER_FILE:
        _reseal(path)
    _refused(path, marker, *words)


def test_unlisted_files_beside_a_transformers_model_are_never_read(saved_llama, llama_copy):
    """A pickle checkpoint and an adapter beside the listed files (not in the header): transformers
    would pick them up from the directory, and attnopt.load shows it only the listed files."""
    path, marker = llama_copy
    _, ids, logits = saved_llama
    (path / "model.safetensors").rename(path / "moved.safetensors")  # only a pickle checkpoint is left
    (path / "pytorch_model.bin").write_bytes(_torch_pickled(marker))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": str(path)}))
    (path / "adapter_model.bin").write_bytes(_torch_pickled(marker))
    _refused(path, marker, "model.safetensors", "missing")
    (path / "moved.safetensors").rename(path / "model.safetensors")
    with torch.no_grad():
        assert torch.equal(attnopt.load(path)(input_ids=ids, use_cache=False).logits, logits)
    assert not marker.exists()
