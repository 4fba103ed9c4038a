"""genai_config.json for onnxruntime-genai 0.18, and the check that genai generates the same tokens.

genai drives a decoder from the config by names: input_ids, attention_mask, position_ids, logits,
the K/V caches past_key_values.%d.key/value (growing, fed a 0-length past first), and fixed-size
state pairs past_key_values.%d.recurrent_state (rank 4) + conv_state (rank 3), zeros first, each
present written over its past. The 0.18 limits (read from its RecurrentState and KV cache):

* every recurrent_state has one shape and dtype, and so does every conv_state;
* a layer carries its K/V or one recurrent + conv pair, nothing else;
* V has K's shape (head dims equal).

A graph whose fixed-size layers break the first two is exported packed (packing.py: each layer's
states in one pair of one shape), which genai drives. What packing cannot mend -- a growing state
besides K/V (reuse's caches), V and K of different head dims -- is said in one warning at export
time, and the folder gets no genai_config.json (genai would load one and fail at the first step);
`attnopt.onnx.Generator` runs it. genai also never masks leading pad tokens at batch > 1 (it pads
on the right): compare batch-1 runs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np

from attnopt.backends.onnx.packing import CONV, RECURRENT, Packing

GENAI_VERSION = "0.18"


def unsupported(layout) -> Optional[str]:
    """Why genai 0.18 cannot drive this graph's state inputs, in one sentence; None when it can."""
    shapes: dict = {RECURRENT: set(), CONV: set()}
    for plan in layout.layers:
        specs = layout.io_specs(plan)
        names = [s.name for s in specs]
        if names == ["key", "value"]:
            if specs[0].shape != specs[1].shape:
                return (f"site {plan.site_id}: its value head dim differs from its key head dim, and onnxruntime-genai "
                        f"{GENAI_VERSION} gives V the shape of K")
            continue
        if names == [RECURRENT, CONV]:
            for spec in specs:
                shapes[spec.name].add((spec.shape, spec.dtype))
            continue
        extra = ", ".join(n for n in names if n not in ("key", "value", RECURRENT, CONV))
        return (f"site {plan.site_id} ({plan.form}) carries {extra or ', '.join(names)} besides its K/V or "
                f"recurrent pair, and onnxruntime-genai {GENAI_VERSION} has one recurrent_state and one conv_state "
                "per layer")
    for name, found in shapes.items():
        if len(found) > 1:
            listed = "; ".join(f"[{', '.join(str(d) for d in shape)}] {str(dtype).replace('torch.', '')}"
                               for shape, dtype in sorted(found, key=str))
            return (f"the fixed-size states differ in shape ({name}: {listed}), and onnxruntime-genai {GENAI_VERSION} "
                    "needs every recurrent_state of one shape and dtype (and every conv_state)")
    return None


def choose_layout(layout) -> Optional[str]:
    """Pack the fixed-size states when that lets genai drive the graph (sets layout.packing); returns
    why genai still cannot, or None."""
    reason = unsupported(layout)
    if reason is None:
        return None
    packed = replace(layout, packing=Packing.of(layout.layers))
    if unsupported(packed) is None:
        layout.packing = packed.packing
        return None
    return reason


def config(model, layout, contract: dict) -> dict:
    """The genai_config.json of a decode folder genai can drive."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    kv = next((p for p in layout.layers if p.states and p.states[0].name == "key"), layout.layers[0])
    g = kv.site.geometry
    context = int(getattr(cfg, "max_position_embeddings", 0) or 4096)
    decoder = {
        "filename": "model.onnx",
        "session_options": {"log_id": "attnopt", "provider_options": []},
        "head_size": g.head_dim, "hidden_size": int(getattr(cfg, "hidden_size", g.heads * g.head_dim)),
        "num_attention_heads": g.heads, "num_key_value_heads": g.kv_heads,
        "num_hidden_layers": int(getattr(cfg, "num_hidden_layers", len(layout.layers))),
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                   "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value",
                   "past_conv_names": "past_key_values.%d.conv_state",
                   "past_recurrent_names": "past_key_values.%d.recurrent_state"},
        "outputs": {"logits": "logits", "present_key_names": "present.%d.key", "present_value_names": "present.%d.value",
                    "present_conv_names": "present.%d.conv_state",
                    "present_recurrent_names": "present.%d.recurrent_state"},
    }
    eos = contract.get("eos_token_id")
    out = {"model": {"type": "decoder", "vocab_size": int(contract["vocab_size"]), "context_length": context,
                     "bos_token_id": _token(contract.get("bos_token_id"), 0),
                     "eos_token_id": eos if isinstance(eos, list) and eos else _token(eos, 0),
                     "pad_token_id": _token(contract.get("pad_token_id"), _token(eos, 0)),
                     "decoder": decoder},
           "search": {"max_length": context, "min_length": 0, "do_sample": False, "num_beams": 1,
                      "num_return_sequences": 1, "past_present_share_buffer": False, "top_k": 1, "top_p": 1.0,
                      "temperature": 1.0, "repetition_penalty": 1.0, "early_stopping": True, "length_penalty": 1.0}}
    return out


def _token(value, default: int) -> int:
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) else default


def greedy_tokens(folder, prompt: list, steps: int) -> np.ndarray:
    """onnxruntime_genai.Model(folder) + Generator, greedy, one prompt (token ids, no tokenizer)."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + steps, batch_size=1, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray([prompt], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return np.asarray(list(generator.get_sequence(0)), dtype=np.int64)


def check(folder, prompt: list, want: list, eos) -> dict:
    """genai's greedy tokens against torch's for `prompt`: "same tokens" (up to genai stopping at its
    eos), "differs", "fails" (genai raised), or "skipped" (not installed); a "note" says why when not same."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return {"status": "skipped", "note": "onnxruntime-genai is not installed, so the genai check was skipped "
                                             "(pip install 'attnopt[onnx]' adds it)"}
    try:
        got = greedy_tokens(folder, prompt, len(want))[len(prompt):].tolist()
    except Exception as exc:  # genai's own error, first line: what it could not do with the folder
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return {"status": "fails", "note": f"onnxruntime-genai fails on it: {first[:300]}"}
    stops = {eos} if isinstance(eos, int) else set(eos or [])
    same = got == want[:len(got)] and (len(got) == len(want) or (got and got[-1] in stops))
    if same:
        return {"status": "same tokens", "tokens": got, "torch": want}
    return {"status": "differs", "tokens": got, "torch": want,
            "note": f"onnxruntime-genai generates {got} where torch generates {want}"}
