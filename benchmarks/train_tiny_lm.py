"""Train a small Llama-style byte-level LM on CPU, so attnopt's decoder fidelity is measured on trained attention.

Random-weight decoders attend almost uniformly, so any form looks faithful on them. This script trains
one on text every Python install carries: the help topics of `pydoc_data.topics` (the text of the
Python reference manual, © Python Software Foundation, PSF License Version 2). Tokens are UTF-8 bytes
(vocabulary 256), so no tokenizer file is needed. Every 10th topic (sorted by name) is held out; the
held-out text is written next to the checkpoint (`heldout.txt`) so that evaluation does not depend on
the Python version's copy of the topics.

    python benchmarks/train_tiny_lm.py --out benchmarks/data/tiny_lm --minutes 15

The checkpoint is a transformers directory (`config.json` + `model.safetensors`, about 4 MB), loaded by
`transformers.LlamaForCausalLM.from_pretrained(dir)`; `train_log.json` has the loss curve and the
held-out perplexity.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

SEQ_LEN = 256
HELD_OUT_EVERY = 10


def corpus() -> tuple[str, str]:
    """(train text, held-out text): the pydoc topics, every HELD_OUT_EVERY-th one held out."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    train = [topics[n] for i, n in enumerate(names) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    held = [topics[n] for i, n in enumerate(names) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    return "\n\n".join(train), "\n\n".join(held)


def encode(text: str):
    """UTF-8 bytes as a 1-D int64 tensor: the model's tokens."""
    import torch

    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def config():
    """4 layers, hidden 128, 4 query / 2 key-value heads (GQA), RoPE, byte vocabulary."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,
    )


def eval_chunks(ids, seq_len: int = SEQ_LEN, limit: int = 0):
    """Non-overlapping [n, seq_len] windows of `ids` (the last partial one dropped); `limit` caps n."""
    n = ids.numel() // seq_len
    if limit:
        n = min(n, limit)
    return ids[: n * seq_len].reshape(n, seq_len)


def perplexity(model, chunks, batch: int = 16) -> float:
    """exp of the mean next-token cross-entropy over every position of every chunk."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, chunks.shape[0], batch):
            x = chunks[i : i + batch]
            logits = model(input_ids=x).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                     reduction="sum")
            total += float(loss)
            count += x[:, 1:].numel()
    return math.exp(total / count)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/data/tiny_lm")
    ap.add_argument("--minutes", type=float, default=15.0, help="wall-time budget for training")
    ap.add_argument("--max-steps", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train_text, held_text = corpus()
    train_ids, held_ids = encode(train_text), encode(held_text)
    held = eval_chunks(held_ids, limit=64)
    model = transformers.LlamaForCausalLM(config())
    model.config._attn_implementation = "sdpa"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    budget_s = args.minutes * 60
    start = time.perf_counter()
    log, step = [], 0
    # The schedule runs on the time budget, not the step count: cosine from lr to lr/10 over the
    # budget, so a slower machine trains fewer steps but still anneals.
    while step < args.max_steps:
        elapsed = time.perf_counter() - start
        if elapsed > budget_s:
            break
        frac = min(elapsed / budget_s, 1.0)
        warm = min(1.0, (step + 1) / 100)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, train_ids.numel() - SEQ_LEN - 1, (args.batch,), generator=gen)
        x = torch.stack([train_ids[s : s + SEQ_LEN] for s in starts.tolist()])
        model.train()
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            log.append({"step": step, "seconds": round(time.perf_counter() - start, 1), "loss": round(float(loss), 4),
                        "lr": lr})
            print(f"step {step} {log[-1]['seconds']:.0f}s loss {float(loss):.3f} lr {lr:.2e}", flush=True)
    model.eval()
    ppl = perplexity(model, held)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "heldout.txt").write_text(held_text, encoding="utf-8")
    info = {
        "corpus": "pydoc_data.topics of Python " + __import__("sys").version.split()[0]
                  + " (Python reference manual text, PSF License Version 2)",
        "held_out": f"every {HELD_OUT_EVERY}th topic in sorted order (heldout.txt)",
        "train_bytes": train_ids.numel(), "held_out_bytes": held_ids.numel(), "seq_len": SEQ_LEN,
        "steps": step, "batch": args.batch, "seconds": round(time.perf_counter() - start, 1),
        "threads": args.threads, "held_out_perplexity": ppl, "held_out_chunks": held.shape[0], "log": log,
    }
    (out / "train_log.json").write_text(json.dumps(info, indent=1))
    print(f"held-out perplexity {ppl:.3f} after {step} steps; saved to {out}")


if __name__ == "__main__":
    main()
