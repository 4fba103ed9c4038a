"""genai_config.json for onnxruntime-genai 0.18, and the check that genai generates the same tokens.

genai drives a decoder from the config by names: input_ids, attention_mask, position_ids, logits,
the K/V caches past_key_values.%d.key/value (growing, fed a 0-length past first), and fixed-size
state pairs past_key_values.%d.recurrent_state (rank 4) + conv_state (rank 3), zeros first. The
0.18 limits that decide whether it can run an export (verified in /work/research/onnx/FINDINGS.md):

* every recurrent_state has one shape and dtype, and so does every conv_state;
* a layer carries nothing besides K/V or one recurrent + conv pair (linear+window's linear_state,
  gla+window's gated_state and gated_keys, and reuse's caches have no genai slot);
* V has K's shape (head dims equal).

When it cannot, the config says so under the key NOT_SUPPORTED (genai then refuses to load it,
naming that key) and the folder is still complete for `attnopt.onnx.Generator`. genai also never
masks leading pad tokens at batch > 1 (it pads on the right): compare batch-1 runs.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

GENAI_VERSION = "0.18"
NOT_SUPPORTED = "not_supported_by_onnxruntime_genai"
_RECURRENT = ("recurrent_state", "conv_state")


def unsupported(layout) -> Optional[str]:
    """Why genai 0.18 cannot drive this graph's states, in one sentence; None when it can."""
    shapes: dict = {"recurrent_state": set(), "conv_state": set()}
    for plan in layout.layers:
        names = [s.name for s in plan.states]
        if names in (["key", "value"], list(_RECURRENT)):
            for s in plan.states:
                if s.name in shapes:
                    shapes[s.name].add((s.shape, s.dtype))
            if names == ["key", "value"] and plan.states[0].shape != plan.states[1].shape:
                return (f"site {plan.site_id}: its value head dim differs from its key head dim, and onnxruntime-genai "
                        f"{GENAI_VERSION} gives V the shape of K")
            continue
        extra = ", ".join(n for n in names if n not in ("key", "value") + _RECURRENT)
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


def config(model, layout, contract: dict, reason: Optional[str]) -> dict:
    """The genai_config.json of a decode folder (with the NOT_SUPPORTED key when `reason`)."""
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
    if reason:
        out = {NOT_SUPPORTED: f"{reason}; run this folder with attnopt.onnx.Generator", **out}
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
    """genai's greedy tokens against torch's for `prompt`: same (up to genai stopping at its eos)."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return {"status": "skipped", "note": "onnxruntime-genai is not installed, so the genai check was skipped "
                                             "(pip install 'attnopt[onnx]' adds it)"}
    got = greedy_tokens(folder, prompt, len(want))[len(prompt):].tolist()
    stops = {eos} if isinstance(eos, int) else set(eos or [])
    same = got == want[:len(got)] and (len(got) == len(want) or (got and got[-1] in stops))
    return {"status": "same tokens" if same else "differs", "tokens": got, "torch": want}
