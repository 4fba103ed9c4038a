"""A graph-path model's captured program on disk: written by `torch.export.save`, read back only
after every part that `torch.export.load` or `ExportedProgram.module()` could turn into code is checked.

torch.export.load is not safe on an untrusted file by itself (torch 2.13, read for this module):
- tensors marked `use_pickle`, custom objects (`custom_obj_*`) and opaque objects (`opaque_obj_*`)
  are unpickled: `torch.load(weights_only=False)`, `torch._C._pickle_load_obj`, `pickle.loads`;
- the sample inputs, and the legacy members (`data/weights/<model>.pt`, `serialized_*.pt`), go
  through `torch.load`, which falls back to `weights_only=False` when the safe load fails;
- `data/aotinductor/` loads a compiled shared library;
- every symbolic size is parsed by `sympy.sympify`, which evals its string;
- `guards_code` is Python source that `.module()` execs;
- a node's target is found by walking attributes from `torch`, `math` or `_operator` (so
  `torch.os.system` resolves), and the graph calls it when it runs;
- parameter paths, forward's argument names and kwargs keys are pasted into the Python code FX
  generates (`getattr(self, "<path>")`, `def forward(self, <names>)`, `{'<key>': ...}`).

`read_program` reads the file once, checks those bytes (through torch's own zip reader, so both
see the same members) and refuses anything above in one line; only then does torch.export.load
read the same bytes, with the weights-only unpickler forced as a second wall. `write_program` saves
what `read_program` accepts: no guard code and no sample inputs.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import io
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

import torch

from attnopt.ir.errors import SaveError

MODEL = "model"  # the one program in the archive (torch.export.save's name for it)
# Members of the archive, relative to its root, and what each may hold.
# Small members torch reads as text, and what each may say.
FIXED_MEMBERS = {"archive_format": re.compile(r"^pt2$"), "archive_version": re.compile(r"^\d{1,4}$"),
                 ".data/version": re.compile(r"^\d{1,4}\n?$"), ".data/serialization_id": re.compile(r"^\w{1,128}$"),
                 "byteorder": re.compile(r"^(little|big)$")}
PROGRAM_MEMBER = f"models/{MODEL}.json"
WEIGHTS_CONFIG = f"data/weights/{MODEL}_weights_config.json"
CONSTANTS_CONFIG = f"data/constants/{MODEL}_constants_config.json"
SAMPLE_INPUTS = f"data/sample_inputs/{MODEL}.pt"  # must be empty: torch.load reads it, with a pickle fallback
PAYLOADS = {"data/weights/": re.compile(r"^weight_\d+$"), "data/constants/": re.compile(r"^tensor_\d+$")}

# Any character that could end a quoted string in generated code, or start a new line of it.
UNSAFE_TEXT = re.compile(r"['\"\\\x00-\x1f\x7f]")
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
NAME = r"[A-Za-z_][A-Za-z0-9_]*"
OP_TARGET = re.compile(rf"^torch\.ops\.({NAME})\.({NAME})(?:\.({NAME}))?$")
# Higher-order ops that only run subgraphs of the same file (export's no_grad / autocast regions,
# control flow); the others run kernels, delegates or objects from elsewhere.
HIGHER_ORDER_OPS = {"wrap_with_set_grad_enabled", "wrap_with_autocast", "cond", "while_loop", "map_impl", "scan",
                    "associative_scan"}
# What a symbolic size may be written with (sympy's srepr): constructors of numbers, symbols and
# the integer functions torch.export prints, called on literals only.
SYMPY_CALLS = {
    "Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Max", "Min", "Abs", "Mod", "floor", "ceiling",
    "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "Equality", "Unequality", "StrictLessThan", "LessThan",
    "StrictGreaterThan", "GreaterThan", "And", "Or", "Not", "Piecewise", "ExprCondPair",
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv",
    "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator",
    "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity",
}
SYMPY_NAMES = {"oo", "zoo", "nan", "true", "false", "S", "Infinity", "NegativeInfinity", "IntInfinity",
               "NegativeIntInfinity", "int_oo", "One", "Zero", "NegativeOne", "Half", "BooleanTrue", "BooleanFalse"}
SYMPY_KEYWORDS = {"positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite", "precision",
                  "evaluate", "commutative", "zero", "nonzero"}
NUMBER_TEXT = re.compile(r"^-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def write_program(program, file: Path) -> None:
    """`program` (an ExportedProgram) as a torch.export archive that `read_program` accepts."""
    saved = copy.copy(program)  # shallow: the same graph, a few fields changed
    saved.example_inputs = None  # written as an empty sample-inputs member
    saved._guards_code = []  # Python source; the loaded model checks its inputs with attnopt's InputGuard
    saved._state_dict = _exact_storages(program.state_dict)
    saved._constants = _exact_storages(program.constants)
    for kind, tensors in (("parameter or buffer", saved._state_dict), ("constant", saved._constants)):
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor) or type(t.data) is not torch.Tensor:  # an object, a tensor subclass
                raise SaveError(f"attnopt.save: the captured program's {kind} {name!r} is a {type(t).__name__}, which "
                                "torch.export.save can only pickle (and attnopt.load never unpickles); make it a plain "
                                "tensor before compiling")
    torch.export.save(saved, file)
    # What this torch wrote must be what attnopt.load reads: a torch that writes more fails here, not on load.
    check_archive(str(file), file, who="attnopt.save: the archive torch.export.save wrote is one attnopt.load refuses:")


def _exact_storages(tensors: dict) -> dict:
    """Each tensor on a storage of exactly its own bytes (a view of a larger one is copied), so every
    payload file is as long as its tensor: `read_program` then refuses a file of any other length.
    Tensors sharing one whole storage (tied weights) still share it."""
    out = {}
    for name, t in tensors.items():
        whole = (isinstance(t, torch.Tensor) and t.storage_offset() == 0 and t.is_contiguous()
                 and t.untyped_storage().nbytes() == t.numel() * t.element_size())
        if isinstance(t, torch.Tensor) and not whole:
            copy_ = t.detach().clone(memory_format=torch.contiguous_format)
            t = torch.nn.Parameter(copy_, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else copy_
        out[name] = t
    return out


def read_program(file: Path):
    """The ExportedProgram in `file`, or SaveError naming the first member or field that could run code."""
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise SaveError(f"attnopt.load: {file} cannot be read ({exc.strerror or exc})") from None
    check_archive(data, file)
    try:
        with _weights_only_unpickler():
            return torch.export.load(io.BytesIO(data))
    except Exception as exc:  # torch.export.load raises many kinds on a file it cannot read
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SaveError(f"attnopt.load: {file} cannot be read as a torch.export program ({first[:300]})") from None


def check_archive(source: "bytes | str", file: Path, who: str = "attnopt.load:") -> None:
    """SaveError unless `source` (the file's bytes, or its path) is an archive whose every member and
    field is plain data; messages start with `who`."""
    where = f"{who} {file}"
    try:
        reader = torch._C.PyTorchFileReader(io.BytesIO(source) if isinstance(source, bytes) else source)
        names = list(reader.get_all_records())
    except Exception as exc:  # not a zip, or not one torch can read
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise SaveError(f"{where} is not a torch.export archive ({first})") from None
    if len(set(names)) != len(names):
        raise SaveError(f"{where} lists an archive member twice; the file is damaged (save the model again)")
    for name in names:
        _check_member_name(name, where)
    for needed in (PROGRAM_MEMBER, WEIGHTS_CONFIG, CONSTANTS_CONFIG, "archive_format"):
        if needed not in names:
            raise SaveError(f"{where} has no member {needed}; it is not an archive attnopt.save wrote")
    for name, pattern in FIXED_MEMBERS.items():  # each torch version writes some of these
        if name in names and not pattern.match(reader.get_record(name).decode("latin-1")):
            raise SaveError(f"{where} member {name} does not hold what torch.export.save writes there")
    if SAMPLE_INPUTS in names and reader.get_record(SAMPLE_INPUTS):
        raise SaveError(f"{where} holds sample inputs ({SAMPLE_INPUTS}), which torch.export.load would unpickle; "
                        "attnopt.save writes none (save the model again)")
    payloads = {n for n in names if any(n.startswith(d) for d in PAYLOADS)} - {WEIGHTS_CONFIG, CONSTANTS_CONFIG}
    listed = set()
    for config, folder in ((WEIGHTS_CONFIG, "data/weights/"), (CONSTANTS_CONFIG, "data/constants/")):
        needs = _check_payload_config(_json_member(reader, config, where), config, folder, where)
        for leaf, nbytes in needs.items():
            member = folder + leaf
            if member not in names:
                raise SaveError(f"{where} member {config} points at {member}, which the archive does not hold")
            got = reader.get_record_size(member)
            if got != nbytes:
                raise SaveError(f"{where} member {member} holds {got} bytes where its tensor takes {nbytes}; "
                                "the file is damaged (save the model again)")
            listed.add(member)
    if payloads - listed:
        raise SaveError(f"{where} holds {sorted(payloads - listed)[0]}, which no payload config lists")
    _check_program(_json_member(reader, PROGRAM_MEMBER, where), f"{where} member {PROGRAM_MEMBER}")


def _check_member_name(name: str, where: str) -> None:
    if name in FIXED_MEMBERS or name in (PROGRAM_MEMBER, WEIGHTS_CONFIG, CONSTANTS_CONFIG, SAMPLE_INPUTS):
        return
    folder, _, leaf = name.rpartition("/")
    pattern = PAYLOADS.get(folder + "/")
    if pattern is not None and pattern.match(leaf):
        return
    raise SaveError(f"{where} holds the member {name!r}, which attnopt.load does not read (torch.export.load could "
                    "unpickle it or load native code from it); save the model again with attnopt.save")


def _json_member(reader, name: str, where: str) -> Any:
    try:
        return json.loads(reader.get_record(name).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise SaveError(f"{where} member {name} is not JSON ({exc})") from None


def _check_payload_config(config: Any, name: str, folder: str, where: str) -> dict:
    """{payload file: bytes it must hold} of a weights/constants config, each entry a plain tensor
    (never a pickle, a custom or an opaque object) of static shape."""
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        raise SaveError(f"{where} member {name} has no 'config' object")
    needs: dict = {}
    for fqn, meta in entries.items():
        _check_text(fqn, f"{where} member {name} key")
        plain = isinstance(meta, dict) and meta.get("use_pickle") is False and isinstance(meta.get("tensor_meta"), dict)
        if not plain:
            raise SaveError(f"{where} member {name}: {fqn!r} is not a plain tensor (it would be unpickled, or is a "
                            "custom object); attnopt.load reads plain tensors only")
        path = meta.get("path_name")
        if not isinstance(path, str) or not PAYLOADS[folder].match(path):
            raise SaveError(f"{where} member {name}: {fqn!r} points at {path!r}, not a plain tensor payload")
        needs[path] = max(needs.get(path, 0), _tensor_bytes(meta["tensor_meta"], f"{where} member {name}: {fqn!r}"))
    return needs


def _tensor_bytes(meta: dict, where: str) -> int:
    """The bytes of storage a serialized tensor's sizes, strides and offset reach."""
    from torch._export.serde.serialize import deserialize_scalar_type
    from torch._export.serde.schema import ScalarType

    def ints(values) -> list:
        if not isinstance(values, list) or not all(isinstance(v, dict) and set(v) == {"as_int"} for v in values):
            raise SaveError(f"{where} has a tensor size that is not a static int list")
        return [v["as_int"] for v in values]

    try:
        itemsize = deserialize_scalar_type(ScalarType(meta.get("dtype"))).itemsize
    except (KeyError, ValueError, TypeError):
        raise SaveError(f"{where} has an unknown dtype {meta.get('dtype')!r}") from None
    sizes, strides, (offset,) = ints(meta.get("sizes")), ints(meta.get("strides")), ints([meta.get("storage_offset")])
    if len(sizes) != len(strides) or any(not isinstance(v, int) or v < 0 for v in sizes + strides + [offset]):
        raise SaveError(f"{where} has sizes, strides or offset that do not describe a tensor")
    if 0 in sizes:
        return 0
    return itemsize * (offset + sum((n - 1) * st for n, st in zip(sizes, strides)) + 1)


def _check_program(program: Any, where: str) -> None:
    """The serialized ExportedProgram holds no guard code, no custom objects, only allowed op targets,
    symbolic sizes made of literals, and no text that could break out of generated code."""
    if not isinstance(program, dict) or not isinstance(program.get("graph_module"), dict):
        raise SaveError(f"{where} is not a serialized ExportedProgram")
    if program.get("guards_code"):
        raise SaveError(f"{where} field 'guards_code' holds Python source (ExportedProgram.module() would exec it); "
                        "attnopt.save writes none")
    for call in program["graph_module"].get("module_call_graph") or []:
        names = ((call or {}).get("signature") or {}).get("forward_arg_names") or []
        for n in names:
            if not isinstance(n, str) or not IDENTIFIER.match(n):
                raise SaveError(f"{where}: forward argument name {n!r} is not a Python identifier (FX pastes it into "
                                "the code it generates)")
    _walk(program, where, "")


def _walk(value: Any, where: str, path: str) -> None:
    if isinstance(value, dict):
        node = {"target", "inputs", "outputs"} <= set(value)
        if node:
            _check_target(value["target"], where)
        for key, item in value.items():
            _check_text(key, f"{where} at {path or 'top'}: key")
            here = f"{path}.{key}" if path else key
            if key == "metadata":  # stack traces and module paths: kept as strings, never code
                continue
            if key in ("as_custom_obj", "custom_obj") or (key == "custom_obj_values" and item):
                raise SaveError(f"{where} at {here}: a custom object (torch.export.load would unpickle it); "
                                "attnopt.load reads tensors and plain values only")
            if key == "expr_str":
                _check_expression(item, where, here)
            elif key in ("in_spec", "out_spec") and isinstance(item, str):
                _walk(_spec(item, where, here), where, here)
            elif key == "target" and node:
                continue  # checked above
            else:
                _walk(item, where, here)
    elif isinstance(value, list):
        for item in value:
            _walk(item, where, path)
    elif isinstance(value, str):
        _check_text(value, f"{where} at {path}")


def _spec(text: str, where: str, path: str) -> Any:
    """A pytree spec: JSON, whose dict-key contexts are JSON again."""
    try:
        spec = json.loads(text)
    except ValueError:
        raise SaveError(f"{where} at {path} is not a JSON tree spec") from None

    def unpack(node):
        if isinstance(node, dict):
            return {k: (unpack(json.loads(v)) if k == "context" and isinstance(v, str) else unpack(v))
                    for k, v in node.items()}
        if isinstance(node, list):
            return [unpack(v) for v in node]
        return node

    try:
        return unpack(spec)
    except ValueError:
        raise SaveError(f"{where} at {path} has a context that is not JSON") from None


def _check_text(text: Any, where: str) -> None:
    if isinstance(text, str) and UNSAFE_TEXT.search(text):
        raise SaveError(f"{where} holds the text {text[:60]!r}, with a quote, backslash or control character that "
                        "could end a string in the code FX generates; attnopt.save writes none")


def _check_target(target: Any, where: str) -> None:
    if not isinstance(target, str):
        raise SaveError(f"{where}: a node target is not a string")
    op = OP_TARGET.match(target)
    if op is not None:
        namespace, name, overload = op.groups()
        if namespace == "higher_order" and (name not in HIGHER_ORDER_OPS or overload is not None):
            raise SaveError(f"{where}: the graph calls {target}, a higher-order op attnopt.load does not run "
                            f"(it runs {', '.join(sorted(HIGHER_ORDER_OPS))} only)")
        if namespace != "higher_order" and overload is None:
            raise SaveError(f"{where}: the graph calls {target}, an op without an overload (torch.export writes "
                            "namespace.op.overload)")
        return
    if target in _symbolic_targets():
        return
    raise SaveError(f"{where}: the graph calls {target!r}, which is neither a registered torch op nor an integer "
                    "operation on sizes; attnopt.load runs only those")


_SYMBOLIC_TARGETS: set = set()


def _symbolic_targets() -> set:
    """The names torch.export writes for integer operations on symbolic sizes (its `_SYM_OPS`), as
    its serializer spells them, plus getitem."""
    if not _SYMBOLIC_TARGETS:
        try:
            from torch._export.serde.serialize import _SYM_OPS
        except ImportError:  # the private set moved: the operations every torch 2.x writes
            import math
            import operator

            _SYM_OPS = {operator.eq, operator.ne, operator.le, operator.ge, operator.lt, operator.gt, operator.neg,
                        operator.pos, math.trunc, torch.sym_not, operator.mul, operator.add, operator.sub,
                        operator.floordiv, operator.mod, operator.pow, torch.sym_int, torch.sym_float, torch.sym_ite,
                        torch.sym_max, torch.sym_min, torch.sym_sqrt, operator.truediv, operator.and_, operator.or_}
        _SYMBOLIC_TARGETS.update(f"{f.__module__}.{f.__name__}" for f in _SYM_OPS)
        _SYMBOLIC_TARGETS.add("_operator.getitem")
    return _SYMBOLIC_TARGETS


def _check_expression(text: Any, where: str, path: str) -> None:
    """A symbolic size as sympy's srepr writes it: allowed constructors called on literals, nothing else
    (sympy.sympify evals the string)."""
    if not isinstance(text, str) or len(text) > 10_000:
        raise SaveError(f"{where} at {path}: a symbolic size is not a short string")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        raise SaveError(f"{where} at {path}: the symbolic size {text[:60]!r} does not parse") from None
    for node in ast.walk(tree):
        if not _allowed_expression_node(node, text):
            raise SaveError(f"{where} at {path}: the symbolic size {text[:80]!r} is not made of sympy numbers, symbols "
                            "and integer functions (sympy.sympify would eval it)")


def _allowed_expression_node(node: ast.AST, text: str) -> bool:
    if isinstance(node, (ast.Expression, ast.Load, ast.USub, ast.UAdd)):
        return True
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, (ast.USub, ast.UAdd))
    if isinstance(node, ast.Call):
        if not (isinstance(node.func, ast.Name) and node.func.id in SYMPY_CALLS):
            return False
        # A string is a symbol's name or a float's digits, in first place only.
        rest = node.args[1:] if node.func.id in ("Symbol", "Float") else node.args
        return not any(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in rest)
    if isinstance(node, ast.keyword):
        return node.arg in SYMPY_KEYWORDS
    if isinstance(node, ast.Name):
        return node.id in SYMPY_CALLS or node.id in SYMPY_NAMES
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, str):
            return bool((IDENTIFIER.match(value) and "__" not in value) or NUMBER_TEXT.match(value))
        return isinstance(value, (bool, int, float))
    return False


@contextlib.contextmanager
def _weights_only_unpickler() -> Iterator[None]:
    """torch.load takes weights_only=True in this block even where torch.export asks for False (its
    fallback); the archive check already refused every member that would need it."""
    key = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
