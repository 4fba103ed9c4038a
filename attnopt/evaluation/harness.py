"""lm-evaluation-harness model "attnopt": HFLM over a compiled attnopt model.

    python -m attnopt.lm_eval --model attnopt --model_args pretrained=DIR,policy=gla+window:64 --tasks TASK
    lm = attnopt.evaluation.lm_eval_model(opt, tokenizer); lm_eval.simple_evaluate(model=lm, tasks=[...])

`pretrained` is an `attnopt.save` directory, or a transformers directory with `policy=` (compiled on
load on the built-in English passages, dispatch off unless `dispatch=auto`). Everything else is
lm-eval's HFLM: batching, log-likelihoods, generation through the model's own `generate()`, so the
rewritten sites decode from their states. Importing this module registers the model with lm-eval.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Optional

if importlib.util.find_spec("lm_eval") is None:  # the extra is optional: one line that says how to get it
    raise ImportError("attnopt's lm-evaluation-harness model needs lm-eval: pip install 'attnopt[eval]'")

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from attnopt.compiler import compile as attnopt_compile
from attnopt.models import task_class
from attnopt.passes.budget import E2E_TOLERANCE
from attnopt.samples import english_passages
from attnopt.saving import load

COMPILE_LENGTH = 256  # tokens per example row when compiling on load


def example_batch(tokenizer: Any, length: int) -> dict:
    """Rows of `length` tokens of the built-in English passages (no padding): compile's example."""
    ids = tokenizer("\n\n".join(english_passages()), add_special_tokens=False)["input_ids"]
    rows = max(1, min(4, len(ids) // length))
    if len(ids) < length:
        length = len(ids)
    input_ids = torch.tensor([ids[i * length : (i + 1) * length] for i in range(rows)], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def _none(value: Any) -> Any:
    return None if isinstance(value, str) and value.lower() == "none" else value


def load_compiled(pretrained: str, tokenizer: Any, policy: Optional[str], dtype: Any = "auto", dispatch: str = "off",
                  tolerance: Optional[float] = None, e2e_tolerance: Optional[float] = E2E_TOLERANCE,
                  compile_length: int = COMPILE_LENGTH):
    """The model lm-eval will run: `attnopt.load(pretrained)`, or `pretrained` compiled with `policy`."""
    import transformers

    path = Path(pretrained)
    torch_dtype = None if dtype in (None, "auto") else (getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    if (path / "attnopt.json").is_file():
        if policy is not None:
            raise ValueError(f"pretrained={pretrained} is an attnopt.save directory, already compiled; drop policy=")
        model = load(path)
        return model.to(torch_dtype) if torch_dtype is not None else model
    if policy is None:
        raise ValueError(f"pretrained={pretrained} is a transformers directory: give policy=... (policy=exact runs it "
                         "unconverted through attnopt), or evaluate it with --model hf")
    cls = task_class(transformers, path)
    model = cls.from_pretrained(str(path), **({"dtype": torch_dtype} if torch_dtype is not None else {})).eval()
    limit = getattr(model.config, "max_position_embeddings", None)
    length = min(int(compile_length), limit) if isinstance(limit, int) else int(compile_length)
    opt = attnopt_compile(model, str(policy), example_inputs=example_batch(tokenizer, length), name=str(path),
                          dispatch=dispatch, tolerance=_none(tolerance), e2e_tolerance=_none(e2e_tolerance))
    report = opt.attnopt_report
    # Said on stderr: a site at or above its tolerance reverts to exact, and then the score is the original's.
    print(f"attnopt: {pretrained} compiled with {policy}: {report.count('rewritten')}/{len(report.sites)} sites "
          f"rewritten (tolerance={tolerance}, e2e_tolerance={e2e_tolerance}, dispatch={dispatch})", file=sys.stderr)
    return opt


@register_model("attnopt")
class AttnoptLM(HFLM):
    """HFLM whose model is compiled by attnopt (or loaded with `attnopt.load`); options as HFLM's, plus
    policy, dispatch ('off' or 'auto'), tolerance, e2e_tolerance ('none': no budget) and compile_length."""

    def __init__(self, pretrained: Any, policy: Optional[str] = None, dispatch: str = "off",
                 tolerance: Optional[float] = None, e2e_tolerance: Any = E2E_TOLERANCE,
                 compile_length: int = COMPILE_LENGTH, **kwargs):
        self._attnopt_options = {"policy": None if policy is None else str(policy), "dispatch": dispatch,
                                 "tolerance": tolerance, "e2e_tolerance": e2e_tolerance,
                                 "compile_length": compile_length}
        if isinstance(pretrained, str) and kwargs.get("tokenizer") is None \
                and (Path(pretrained) / "attnopt.json").is_file() \
                and not any((Path(pretrained) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            raise ValueError(f"pretrained={pretrained} holds no tokenizer (attnopt.save keeps none): add "
                             "tokenizer=PATH to --model_args")
        super().__init__(pretrained=pretrained, **kwargs)
        if self.prefix_token_id is None:  # HFLM would fail later, deep in tok_encode, with a TypeError
            raise ValueError("the tokenizer has no BOS or EOS token for lm-eval to put before a context; add "
                             "prefix_token_id=N to --model_args (e.g. prefix_token_id=10, a newline, for a byte-level "
                             "tokenizer)")

    def _create_model(self, pretrained: str, dtype: Any = "auto", **kwargs) -> None:
        # HFLM calls this for a string `pretrained` after it made the tokenizer; its PEFT, quantisation and
        # device-map options do not apply to a compiled model.
        self._model = load_compiled(pretrained, self.tokenizer, dtype=dtype, **self._attnopt_options)

    def _get_config(self, pretrained: str, **kwargs) -> None:
        import transformers

        # An attnopt.save directory's config names attnopt's loader as its attention implementation; the
        # config itself reads as the model's own.
        self._config = transformers.AutoConfig.from_pretrained(pretrained)


def lm_eval_model(model: Any, tokenizer: Any, **kwargs) -> AttnoptLM:
    """The HFLM for `lm_eval.simple_evaluate(model=...)` over an in-memory (compiled) model and its tokenizer
    (an object or a directory); kwargs are HFLM's (batch_size, max_length, ...)."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"lm_eval_model needs a transformers model (compiled or not); got {type(model).__name__}")
    kwargs.setdefault("batch_size", 1)
    return AttnoptLM(pretrained=model, tokenizer=tokenizer, **kwargs)
