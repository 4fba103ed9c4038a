"""`opt.forward = torch.compile(opt.forward)` and generate(): the state layers are bound outside the
compiled forward and the decode step asks the data nothing, so the traced model has no graph break
and compiles the same few frames whatever the number of generated tokens (no recompile per token,
no recompile limit; transformers' shared `deprecate_kwarg` wrapper makes every break expensive)."""

import pytest
import torch

import attnopt

transformers = pytest.importorskip("transformers")
dynamo = pytest.importorskip("torch._dynamo")

from torch._dynamo.testing import CompileCounter  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from attnopt.hf.cache import SiteCacheLayer  # noqa: E402


def _frames(model, ids, new):
    """Frames Dynamo compiles for one generate() of `new` tokens, its graph breaks, the tokens."""
    dynamo.reset()
    counters.clear()
    count = CompileCounter()
    eager = model.forward
    model.forward = torch.compile(eager, backend=count)
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=new, do_sample=False, pad_token_id=0,
                                 return_dict_in_generate=True)
    finally:
        model.forward = eager
        dynamo.reset()
    return count.frame_count, sum(counters["graph_break"].values()), out


def test_generation_under_torch_compile_does_not_recompile_per_token():
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).eval()
    base.generation_config.eos_token_id = None
    ids = torch.randint(3, 97, (1, 9), generator=torch.Generator().manual_seed(3))
    # Default dispatch: the sites run exact below their threshold, through the state's exact prefix.
    opt = attnopt.compile(base, "linear", example_inputs={"input_ids": ids, "use_cache": False}, e2e_tolerance=None)
    assert opt.attnopt_report.count("rewritten") == 2
    with torch.no_grad():
        eager = opt.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    short, short_breaks, _ = _frames(opt, ids, 3)  # prefill, a first step, a step with a longer cache
    long, long_breaks, out = _frames(opt, ids, 8)
    original, _, _ = _frames(base, ids, 8)
    assert short == long <= original, (short, long, original)  # measured 3, 3, 3 (before: 12 and the limit)
    assert short_breaks == long_breaks == 0
    assert torch.equal(out.sequences, eager)
    assert all(isinstance(layer, SiteCacheLayer) for layer in out.past_key_values.layers)
