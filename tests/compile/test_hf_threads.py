"""Threads sharing one compiled transformers model get exactly what each gets alone.

Nothing one call computes may live on a module: not the cache layer a site decodes from, not a reuse
anchor's q and k, not the layer input x. A barrier inside the attention function of one layer makes
every thread reach it before any goes on -- after each has bound its cache layer, stored its anchor's
(q, k) and its x for that layer and step -- so per-call state kept on the module is overwritten by
the other threads every time (the interleaving is forced, not hoped for).
"""

import threading

import pytest
import torch

import attnopt

transformers = pytest.importorskip("transformers")

from transformers import AttentionInterface  # noqa: E402

from attnopt.hf.interface import IMPL_SDPA, attention_forward, register_names  # noqa: E402

THREADS, PROMPT, NEW = 3, 10, 4


@pytest.fixture(scope="module")
def llama():
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 97, (1, PROMPT), generator=g) for _ in range(THREADS)]


def _compile(base, policy):
    ids = torch.cat(_prompts())
    opt = attnopt.compile(base, policy, example_inputs={"input_ids": ids, "use_cache": False}, e2e_tolerance=None,
                          dispatch="off")
    assert opt.attnopt_report.count("rewritten") >= 1
    opt.generation_config.eos_token_id = None  # every thread runs every step: the barrier needs all of them
    return opt


def _in_threads(model, module_paths, work):
    """Run work(i) in THREADS threads that all meet at a barrier inside the attention function of
    each module of `module_paths` (one path or several) on every call; returns the results by thread
    (or raises the first error)."""
    paths = [module_paths] if isinstance(module_paths, str) else module_paths
    targets = {id(model.get_submodule(p)) for p in paths}
    barrier = threading.Barrier(THREADS, timeout=60)
    waits = [0] * THREADS
    index = {}

    def gated(module, *args, **kwargs):
        i = index.get(threading.get_ident())
        if id(module) in targets and i is not None:
            waits[i] += 1
            barrier.wait()
        return attention_forward(module, *args, **kwargs)

    results, errors = [None] * THREADS, []

    def run(i):
        index[threading.get_ident()] = i
        try:
            results[i] = work(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()

    AttentionInterface.register(IMPL_SDPA, gated)
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        register_names()  # attnopt's own function again
    if errors:
        raise errors[0]
    assert min(waits) >= 1 and len(set(waits)) == 1, waits  # every thread met the others at every call
    return results


@torch.no_grad()
def _generate(model, ids):
    out = model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1)


def test_threads_generating_from_decode_states_equal_the_serial_runs(llama):
    opt = _compile(llama, "linear")
    prompts = _prompts()
    serial = [_generate(opt, ids) for ids in prompts]
    threaded = _in_threads(opt, "model.layers.1.self_attn", lambda i: _generate(opt, prompts[i]))
    for (seq, logits), (seq_t, logits_t) in zip(serial, threaded):
        assert torch.equal(seq, seq_t)
        assert torch.equal(logits, logits_t)
    # The prompts differ, so a thread reading another's state could not pass by luck.
    assert not torch.equal(serial[0][1], serial[1][1])


# Every form that decodes from a state of its own, one per layer of one model.
STATE_FORMS = [("ssm", {}), ("window", {"window": 4, "sinks": 1}), ("linear+window", {"window": 4}),
               ("gla", {}), ("gla+window", {"window": 4}), ("delta", {})]


def test_threads_generating_every_state_form_equal_the_serial_runs():
    """ssm, window, linear+window, gla, gla+window and delta, a layer each, with every thread meeting
    the others inside every layer's attention at every step: each thread's tokens and logits are its
    serial run's, bit for bit."""
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=len(STATE_FORMS), num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).eval()
    policy = {"rules": [{"layers": str(i), "form": form, "tolerance": 10.0, **params}
                        for i, (form, params) in enumerate(STATE_FORMS)]}
    opt = _compile(base, policy)
    assert [r.outcome.final_form for r in opt.attnopt_report.sites] == [f for f, _ in STATE_FORMS]
    prompts = _prompts()
    serial = [_generate(opt, ids) for ids in prompts]
    layers = [f"model.layers.{i}.self_attn" for i in range(len(STATE_FORMS))]
    threaded = _in_threads(opt, layers, lambda i: _generate(opt, prompts[i]))
    for (seq, logits), (seq_t, logits_t) in zip(serial, threaded):
        assert torch.equal(seq, seq_t) and torch.equal(logits, logits_t)
    assert not torch.equal(serial[0][1], serial[1][1])


def test_threads_running_a_reuse_model_equal_the_serial_runs(llama):
    # Layer 1 reads layer 0's q and k of the same forward call, and its selection state from the cache.
    opt = _compile(llama, {"rules": [{"layers": "0", "form": "exact"},
                                     {"layers": "1", "form": "reuse", "anchor": 0, "block": 2, "top_k": 1}]})
    assert [r.outcome.final_form for r in opt.attnopt_report.sites] == ["exact", "reuse"]
    prompts = _prompts()
    with torch.no_grad():
        serial = [opt(input_ids=ids, use_cache=False).logits for ids in prompts]

        def work(i):
            return [opt(input_ids=prompts[i], use_cache=False).logits for _ in range(3)]

        threaded = _in_threads(opt, "model.layers.1.self_attn", work)
    for alone, runs in zip(serial, threaded):
        assert all(torch.equal(alone, run) for run in runs)
    # Generation decodes from the selection state the cache holds: threads again equal serial.
    serial_gen = [_generate(opt, ids) for ids in prompts]
    threaded_gen = _in_threads(opt, "model.layers.1.self_attn", lambda i: _generate(opt, prompts[i]))
    for (seq, logits), (seq_t, logits_t) in zip(serial_gen, threaded_gen):
        assert torch.equal(seq, seq_t) and torch.equal(logits, logits_t)
