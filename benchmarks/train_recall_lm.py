"""Train `recall_lm`: a small byte-level Llama-style decoder that retrieves, so attnopt's quality is measured where a cheap form can fail.

`tiny_lm` models local text and never needed long-range attention: it predicts a repeated random key
at chance. This model is trained on real text (the Python reference manual in `pydoc_data.topics` and
the standard library's docstrings, both carried by every Python install) mixed with synthetic recall
written into that text, so that induction and lookup heads form:

* random keys (several alphabets and lengths) written twice or three times, at distances up to the
  context;
* spans of real text repeated later;
* key→value lists queried later (MQAR-like);
* pass keys in repetitive filler.

Training runs short to long (256 → 512 → 1024 → 2048 tokens) for a fixed number of steps, with a
cosine learning rate; about 75 minutes on 2 cores (`train_seconds` in the log says how long it
took). The shipped model is that run continued for 2,000 steps more with a later mix (more keys, half
of them bare, extra weight on the bytes inside copies): `runs` in the log gives both commands and
times, 140 minutes in all. Held out from training, and measured at the end into `train_log.json`:
every 10th pydoc topic and every 10th docstring module (`heldout.txt`), and probe formats the data
never used: key lengths 12 and 20 (never drawn), an upper-case-only and a Greek alphabet (never drawn),
and a filler text of its own.

`--size large --device cuda --minutes M` trains the larger model a GPU loan is for (benchmarks/README.md),
for M minutes of wall time instead of a step count.

    python benchmarks/train_recall_lm.py --out /tmp/recall_lm_run1
    python benchmarks/train_recall_lm.py --init /tmp/recall_lm_run1 --out benchmarks/data/recall_lm \
        --phases 600:1024:8,1400:2048:4 --lr 1e-3 --copy-weight 2 --event-mix 0.55:0.20:0.25 --bare-keys 0.5

The output is a transformers directory (`config.json`, `model.safetensors`, a byte-level
`tokenizer.json`) that `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` load as any model.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import string
import sys
import sysconfig
import time
from pathlib import Path

HELD_OUT_EVERY = 10
# (steps, sequence length, batch): short to long. Steps, not wall time, so a busy machine trains the
# same model, only later.
PHASES = ((700, 256, 32), (600, 512, 16), (800, 1024, 8), (1100, 2048, 4))
SEQ_LEN = PHASES[-1][1]

# Key alphabets and lengths drawn in training. Lengths 12 and 20, upper-case-only and Greek keys are
# never drawn: the probes in train_log.json use them.
TRAIN_ALPHABETS = (
    string.ascii_lowercase, string.digits, string.ascii_lowercase + string.digits, string.hexdigits[:16],
    string.ascii_letters, string.ascii_letters + string.digits, string.ascii_letters + string.digits + string.punctuation,
)
TRAIN_KEY_LENGTHS = tuple(n for n in range(3, 33) if n not in (12, 20))
KEY_PREFIXES = ("", " ", "key: ", "id=", "[", "\"", "code ", "#", " token ", "ref:")
TRAIN_FILLER = (
    "The river flows past the old mill. ", "A gentle wind moves through the tall grass. ",
    "Clouds drift slowly over the quiet hills. ", "The market opens early on most days. ",
    "Birds gather on the roof at dusk. ", "The library keeps its doors open until nine. ",
)
PASSKEY_OPENERS = ("The pass key is {k}. Remember it. {k} is the pass key. ",
                   "Important: the secret number is {k}. Keep it in mind. ")
PASSKEY_QUESTIONS = ("What is the pass key? The pass key is {k}",
                     "What was the secret number? The secret number is {k}")
# Probe-only formats (train_log.json): never produced by `Sampler`.
PROBE_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
PROBE_ALPHABETS = {"upper": string.ascii_uppercase, "digits": string.digits, "lower": string.ascii_lowercase,
                   "greek": "αβγδεζηθικλμνξοπρστυφχψω"}


def stdlib_docstrings(min_chars: int = 300) -> list[tuple[str, str]]:
    """(module path, docstring) for every long docstring of the standard library (tests excluded), in path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        if any(part in {"test", "tests", "idlelib", "site-packages", "lib2to3"} for part in path.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    docs.append((str(path.relative_to(root)), doc))
    return docs


def corpus() -> tuple[str, str]:
    """(train text, held-out text): pydoc topics and stdlib docstrings, every 10th topic / module held out."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    held = [topics[n] for i, n in enumerate(names) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [topics[n] for i, n in enumerate(names) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    modules = sorted({m for m, _ in stdlib_docstrings()})
    held_modules = {m for i, m in enumerate(modules) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1}
    for module, doc in stdlib_docstrings():
        (held if module in held_modules else train).append(doc)
    return "\n\n".join(train), "\n\n".join(held)


# (layers, hidden, query heads, key-value heads): `cpu` is the shipped recall_lm (the test fixture);
# `large` the one a GPU loan trains (head size 32 in both, so the supervised heads mean the same).
SIZES = {"cpu": (6, 128, 4, 2), "large": (8, 256, 8, 4)}


def config(size: str = "cpu"):
    """Llama-style GQA decoder (SIZES; `cpu`: 6 layers, hidden 128, 4 query / 2 key-value heads), RoPE, byte
    vocabulary, context 2048."""
    import transformers

    layers, hidden, heads, kv_heads = SIZES[size]
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def byte_tokenizer():
    """A `PreTrainedTokenizerFast` whose token id is the UTF-8 byte value (0-255), no special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    # ByteLevel maps byte b to a printable character; rebuild that map to give character(b) the id b.
    byte_chars = _bytes_to_unicode()
    assert set(byte_chars.values()) == set(alphabet)
    vocab = {byte_chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                                   model_max_length=SEQ_LEN)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (the one `ByteLevel` uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class Sampler:
    """Training sequences: a window of real text with recall events written over it."""

    def __init__(self, text: bytes, seed: int, event_mix=(0.45, 0.25, 0.30), bare_keys: float = 0.0,
                 edges: float = 0.0):
        self.text = text
        self.rng = random.Random(seed)
        self.key_share, self.span_share = event_mix[0], event_mix[0] + event_mix[1]  # the rest: MQAR lists
        self.bare_keys = bare_keys  # share of key events written with no "the code is"-style prefix
        # share of key copies and pass keys placed at the ends of the distance range: the later copy
        # within EDGE bytes of the first, or the first in the row's first 1/8 and the later in its last
        self.edges = edges
        self.copies: list[tuple[int, int, int]] = []  # (first copy's start, a later copy's start, length)

    def key(self) -> bytes:
        return self.key_of(self.rng.choice(TRAIN_KEY_LENGTHS))

    def key_of(self, length: int) -> bytes:
        alphabet = self.rng.choice(TRAIN_ALPHABETS)
        return "".join(self.rng.choice(alphabet) for _ in range(length)).encode()

    def text_window(self, n: int) -> bytearray:
        start = self.rng.randrange(0, len(self.text) - n - 1)
        return bytearray(self.text[start:start + n])

    def place(self, seq: bytearray, chunk: bytes, lo: int, hi: int) -> int | None:
        """Write `chunk` at a random offset in [lo, hi - len(chunk)]; return the offset (None if it cannot fit)."""
        hi = min(hi, len(seq)) - len(chunk)
        if hi < lo:
            return None
        at = self.rng.randint(lo, hi)
        seq[at:at + len(chunk)] = chunk
        return at

    def copy_event(self, seq: bytearray, chunk: bytes) -> None:
        """`chunk` written, then written again once or twice further on."""
        if self.edges and self.rng.random() < self.edges:  # no draw at 0: earlier runs' streams stay
            self.edge_copy(seq, chunk)
            return
        first = at = self.place(seq, chunk, 0, len(seq) - len(chunk) - 1)
        for _ in range(self.rng.choice((1, 1, 1, 2))):
            if at is None:
                return
            at = self.place(seq, chunk, at + len(chunk), len(seq))
            if at is not None:
                self.copies.append((first, at, len(chunk)))

    def edge_copy(self, seq: bytearray, chunk: bytes) -> None:
        """`chunk` and one later copy at an end of the distance range: right after it, or across the row."""
        n, k = len(seq), len(chunk)
        if self.rng.random() < 0.5:
            first = self.place(seq, chunk, 0, n - 2 * k - 1)
            later = None if first is None else self.place(seq, chunk, first + k, first + 2 * k + EDGE)
        else:
            first = self.place(seq, chunk, 0, n // 8 + k)
            later = None if first is None else self.place(seq, chunk, max(first + k, n - n // 8 - k), n)
        if later is not None:
            self.copies.append((first, later, k))

    def mqar(self, seq: bytearray) -> None:
        """A key→value list, then some of its pairs asked again, in another order, further on."""
        pairs = []
        for _ in range(self.rng.randint(3, 10)):
            k = "".join(self.rng.choice(string.ascii_lowercase) for _ in range(self.rng.randint(3, 6)))
            v = "".join(self.rng.choice(self.rng.choice((string.digits, string.ascii_uppercase)))
                        for _ in range(self.rng.randint(2, 6)))
            pairs.append((k, v))
        sep = self.rng.choice(("=", ": ", " -> "))
        listing = ("; ".join(f"{k}{sep}{v}" for k, v in pairs) + ". ").encode()
        at = self.place(seq, listing, 0, len(seq) // 2)
        if at is None:
            return
        lo = at + len(listing)
        for k, v in self.rng.sample(pairs, self.rng.randint(1, len(pairs))):
            lo_next = self.place(seq, f" {k}{sep}{v}.".encode(), lo, len(seq))
            if lo_next is None:
                return
            lo = lo_next

    def passkey(self, n: int) -> bytearray:
        """Repetitive filler with a pass key at a random depth and the question at the end."""
        key = "".join(self.rng.choice(string.digits) for _ in range(self.rng.randint(4, 9)))
        which = self.rng.randrange(len(PASSKEY_OPENERS))
        question = PASSKEY_QUESTIONS[which].format(k=key).encode()
        needle = PASSKEY_OPENERS[which].format(k=key).encode()
        sentences = self.rng.sample(TRAIN_FILLER, self.rng.randint(2, len(TRAIN_FILLER)))
        filler = bytearray()
        while len(filler) < n:
            filler += self.rng.choice(sentences).encode()
        seq = filler[: n - len(question)] + question
        lo, hi = 0, n - len(question) - 1
        if self.edges and self.rng.random() < self.edges:  # the key right before the question, or at the start
            lo, hi = (max(0, hi - len(needle) - EDGE), hi) if self.rng.random() < 0.5 else (0, len(needle) + n // 8)
        self.place(seq, needle, lo, hi)
        return seq[:n]

    def sequence(self, n: int, repeat_share: float = 0.15) -> bytes:
        self.copies = []
        r = self.rng.random()
        if r < 0.12:
            return bytes(self.passkey(n))
        if r < 0.12 + repeat_share:  # a window, then the same window again: where induction heads form first
            # Random bytes half of the time: nothing but copying predicts their second copy.
            width = self.rng.randint(n // 8, n // 2)
            half = self.text_window(width) if self.rng.random() < 0.5 else bytearray(self.key_of(width))
            seq = self.text_window(n)
            at = self.rng.randint(0, n - 2 * len(half))
            seq[at:at + len(half)] = half
            seq[at + len(half):at + 2 * len(half)] = half
            self.copies.append((at, at + len(half), len(half)))
            return bytes(seq)
        seq = self.text_window(n)
        if r < 0.2 + repeat_share:  # plain text: the model must still model language
            return bytes(seq)
        for _ in range(self.rng.randint(1, max(2, n // 128))):
            kind = self.rng.random()
            if kind < self.key_share:  # no extra draw when bare_keys is 0: the first run's stream stays as it was
                bare = self.bare_keys > 0 and self.rng.random() < self.bare_keys
                prefix = "" if bare else self.rng.choice(KEY_PREFIXES)
                self.copy_event(seq, prefix.encode() + self.key())
            elif kind < self.span_share:
                span = self.text_window(self.rng.randint(16, max(16, min(256, n // 4))))
                self.copy_event(seq, bytes(span))
            else:
                self.mqar(seq)
        return bytes(seq)

    def batch(self, batch: int, n: int, repeat_share: float = 0.15):
        """(ids [batch, n], induction targets [batch, n]): for a position t inside a later copy, or ending a
        context seen once before (`repeat_targets`), the position just after its earlier twin (where an
        induction head looks to predict t + 1); -1 elsewhere."""
        import torch

        rows, targets = [], []
        for _ in range(batch):
            seq = self.sequence(n, repeat_share)
            target = [-1] * n
            for first, later, length in self.copies:
                for i in range(length - 1):
                    t, j = later + i, first + i + 1
                    # Later events may have written over a copy: keep only targets that still hold.
                    if t + 1 < n and seq[t] == seq[j - 1] and seq[t + 1] == seq[j]:
                        target[t] = j
            repeat_targets(seq, target)
            rows.append(list(seq))
            targets.append(target)
        return torch.tensor(rows, dtype=torch.long), torch.tensor(targets, dtype=torch.long)


EDGE = 96  # bytes: the most a "near" edge copy starts after its first copy ends
REPEAT_CONTEXTS = (4, 8, 16)  # bytes of context a repeat target must match, shortest first


def repeat_targets(seq, target: list) -> None:
    """Fill `target[t]` (where still -1) with j + 1 when the `c` bytes ending at t occurred exactly once
    before, ending at j, and the byte after both agrees, for the shortest such c in REPEAT_CONTEXTS.
    One shared byte is ambiguous in text ("e" is everywhere); a unique multi-byte context is not, and
    it is what finds a pass key after "the code is" or a key's next letter among lower-case text."""
    n = len(seq)
    for c in REPEAT_CONTEXTS:
        seen: dict = {}
        for t in range(c - 1, n - 1):
            gram = bytes(seq[t - c + 1:t + 1])
            j = seen.get(gram)
            if j is not None and j >= 0 and target[t] < 0 and j + 1 < t and seq[j + 1] == seq[t + 1]:
                target[t] = j + 1
            seen[gram] = t if j is None else -1  # -1: seen more than once, no unique twin


# Attention supervision while training: q and k (after RoPE) of chosen query heads in the first two
# layers. Layer 0 holds three heads looking 1, 2 and 3 bytes back, so that layer 1's induction head
# can match a multi-byte context rather than a single byte.
AUX_HEADS = {(0, 0): "previous token", (0, 1): "2 tokens back", (0, 2): "3 tokens back", (1, 0): "induction"}
BACK = {"previous token": 1, "2 tokens back": 2, "3 tokens back": 3}
_AUX_QK: dict = {}


def recording_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, keeping the supervised query heads and their key heads."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if module.training:
        group = query.shape[1] // key.shape[1]
        for layer, head in AUX_HEADS:
            if layer == module.layer_idx:
                _AUX_QK[(layer, head)] = (query[:, head], key[:, head // group], module.scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def attention_aux_loss(induction_BN):
    """Mean -log attention of the supervised heads on their targets: layer 0's heads on the token 1, 2
    or 3 back, layer 1 head 0 on the position after the current context's earlier twin. Induction
    heads form late from the language-model loss alone (not within a CPU budget at this size); this makes
    them form in a few hundred steps, and the rest of the circuit is learned from the data."""
    import torch

    losses = []
    for head, (q_BND, k_BND, scale) in _AUX_QK.items():
        N = q_BND.shape[1]
        logits = (q_BND @ k_BND.transpose(1, 2)).float() * scale
        causal = torch.ones(N, N, dtype=torch.bool, device=logits.device).tril()
        logp = logits.masked_fill(~causal, float("-inf")).log_softmax(-1)
        back = BACK.get(AUX_HEADS[head])
        if back is not None:
            idx = torch.arange(back, N, device=logits.device)
            losses.append(-logp[:, idx, idx - back].mean())
        else:
            b, t = (induction_BN >= 0).nonzero(as_tuple=True)
            if b.numel():
                losses.append(-logp[b, t, induction_BN[b, t]].mean())
    _AUX_QK.clear()
    return sum(losses) if losses else None


def _device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def perplexity(model, ids, seq_len: int, batch: int = 4) -> tuple[float, int]:
    """exp of the mean next-token cross-entropy over non-overlapping seq_len windows of `ids`; (ppl, windows)."""
    import torch

    n = ids.numel() // seq_len
    chunks = ids[: n * seq_len].reshape(n, seq_len)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, n, batch):
            x = chunks[i:i + batch].to(model.device)
            logits = model(input_ids=x).logits[:, :-1]
            total += float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"))
            count += x[:, 1:].numel()
    return math.exp(total / count), n


def recall_probe(model, held: bytes, *, alphabet: str, key_len: int, distance: int, filler: str | None,
                 seq_len: int, trials: int, seed: int) -> float:
    """Teacher-forced accuracy on the 2nd..last bytes of a key's second copy, `distance` bytes after the first.

    The context is held-out text (or `filler` repeated); the key is written at a random place, then again
    `distance` bytes after its start, ending near the end of the window. Scored on every byte of the second
    copy after the first (the first byte of a bare key cannot be known).
    """
    import torch

    rng = random.Random(seed)
    hits = total = 0
    for _ in range(trials):
        key = "".join(rng.choice(alphabet) for _ in range(key_len)).encode()
        if filler is None:
            start = rng.randrange(0, len(held) - seq_len - 1)
            ctx = bytearray(held[start:start + seq_len])
        else:
            ctx = bytearray((filler * (seq_len // len(filler) + 2)).encode()[:seq_len])
        second = seq_len - len(key) - rng.randint(1, 16)
        first = second - distance
        ctx[first:first + len(key)] = key
        ctx[second:second + len(key)] = key
        x = torch.tensor([list(ctx)], dtype=torch.long)
        with torch.no_grad():
            pred = model(input_ids=x.to(model.device)).logits[0].argmax(-1).cpu()
        # pred[t] predicts token t+1; score tokens second+1 .. second+len(key)-1.
        idx = torch.arange(second + 1, second + len(key))
        hits += int((pred[idx - 1] == x[0, idx]).sum())
        total += idx.numel()
    return hits / total


def probes(model, held: bytes, seq_len: int, trials: int) -> dict:
    """Recall at several distances for formats the training data never drew."""
    out = {}
    for name, alphabet, key_len, filler in (
            ("upper12_text", PROBE_ALPHABETS["upper"], 12, None), ("digits12_text", PROBE_ALPHABETS["digits"], 12, None),
            ("lower12_text", PROBE_ALPHABETS["lower"], 12, None), ("lower20_text", PROBE_ALPHABETS["lower"], 20, None), ("greek12_text", PROBE_ALPHABETS["greek"], 12, None),
            ("upper12_filler", PROBE_ALPHABETS["upper"], 12, PROBE_FILLER)):
        key_bytes = len(alphabet[0].encode()) * key_len
        distances = [d for d in (64, 256, seq_len // 4, seq_len // 2, 3 * seq_len // 4, seq_len - 128)
                     if d <= seq_len - key_bytes - 16]
        out[name] = {str(d): round(recall_probe(model, held, alphabet=alphabet, key_len=key_len, distance=d,
                                                filler=filler, seq_len=seq_len, trials=trials, seed=d), 4)
                     for d in distances}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/data/recall_lm")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probe-trials", type=int, default=24)
    ap.add_argument("--event-mix", default="0.45:0.25:0.30",
                    help="KEYS:SPANS:MQAR shares of the recall events written over text")
    ap.add_argument("--bare-keys", type=float, default=0.0,
                    help="share of key events written bare, with no 'the code is'-style prefix before them")
    ap.add_argument("--edges", type=float, default=0.0,
                    help="share of key copies and pass keys placed at the ends of the distance range (a later copy "
                         "right after the first, or the two across the whole row)")
    ap.add_argument("--copy-weight", type=float, default=0.0, help="extra weight of the next-byte loss inside later copies")
    ap.add_argument("--aux-weight", type=float, default=1.0, help="weight of the attention supervision loss")
    ap.add_argument("--steps-scale", type=float, default=1.0, help="multiply every phase's steps (smoke runs)")
    ap.add_argument("--phases", default=None, help="STEPS:LEN:BATCH,... instead of the built-in schedule")
    ap.add_argument("--init", default=None, help="continue training a saved recall_lm directory (its log is kept)")
    ap.add_argument("--size", choices=sorted(SIZES), default=None,
                    help="model size (SIZES; default cpu): cpu, the shipped test fixture; large, for a GPU")
    ap.add_argument("--device", default="cpu", help="torch device to train on (cuda on a GPU machine)")
    ap.add_argument("--minutes", type=float, default=None,
                    help="train for this wall time instead of a step count: the phases and the learning-rate "
                         "schedule follow the elapsed share of it (a GPU loan's fixed minutes)")
    args = ap.parse_args(argv)
    if args.init and args.size:
        ap.error(f"--size {args.size} with --init: a continued run keeps the size of {args.init}; drop --size")
    if args.minutes is not None and args.minutes <= 0:
        ap.error(f"--minutes {args.minutes}: give a positive number of minutes")

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    try:
        device = torch.device(args.device)
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as e:
        ap.error(f"--device {args.device!r} is not usable here ({str(e).splitlines()[0]}); give cpu or an available "
                 "accelerator")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    train_text, held_text = corpus()
    train_bytes, held_bytes = train_text.encode("utf-8"), held_text.encode("utf-8")
    try:
        mix = tuple(float(v) for v in args.event_mix.split(":"))
    except ValueError:
        mix = ()
    if len(mix) != 3 or abs(sum(mix) - 1) > 1e-6 or min(mix) < 0:
        ap.error(f"--event-mix {args.event_mix!r}: give three non-negative shares KEYS:SPANS:MQAR summing to 1")
    if not 0 <= args.edges <= 1:
        ap.error(f"--edges {args.edges}: give a share between 0 and 1")
    sampler = Sampler(train_bytes, args.seed, event_mix=mix, bare_keys=args.bare_keys, edges=args.edges)
    earlier = None
    if args.init:
        model = transformers.LlamaForCausalLM.from_pretrained(args.init)
        earlier = json.loads((Path(args.init) / "train_log.json").read_text())
    else:
        model = transformers.LlamaForCausalLM(config(args.size or "cpu"))
    model.to(device)
    transformers.AttentionInterface.register("recording_sdpa", recording_sdpa)
    model.config._attn_implementation = "recording_sdpa"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    schedule = PHASES if args.phases is None else [tuple(int(x) for x in p.split(":")) for p in args.phases.split(",")]
    phases = [(max(1, round(k * args.steps_scale)), n, b) for k, n, b in schedule]
    total_steps = sum(p[0] for p in phases)
    ends = [sum(p[0] for p in phases[:i + 1]) for i in range(len(phases))]
    start = time.perf_counter()
    budget = None if args.minutes is None else 60 * args.minutes

    def progress() -> float:  # the share of training done: of the steps, or of the wall time given
        return step / total_steps if budget is None else (time.perf_counter() - start) / budget

    log, step, taken = [], 0, [0] * len(phases)
    while progress() < 1:
        done = progress()
        at = step if budget is None else done * total_steps  # where in the step schedule training is
        phase = next((i for i, end in enumerate(ends) if at < end), len(phases) - 1)
        taken[phase] += 1
        _, seq_len, batch = phases[phase]
        # Cosine from lr to lr/10 over all of training, after a short warm-up.
        warm = 1.0 if earlier else min(1.0, (step + 1) / 200)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))
        for group in opt.param_groups:
            group["lr"] = lr
        # The first phase repeats whole windows half the time: induction forms there, and the longer
        # phases then stretch it over distance.
        x, induction = sampler.batch(batch, seq_len, repeat_share=0.5 if phase == 0 else 0.25)
        x, induction = x.to(device), induction.to(device)
        model.train()
        logits = model(input_ids=x).logits[:, :-1]
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                               reduction="none").view(x.shape[0], -1)
        loss = ce.mean()
        in_copy = induction[:, :-1] >= 0
        if args.copy_weight and bool(in_copy.any()):
            loss = loss + args.copy_weight * ce[in_copy].mean()
        aux = attention_aux_loss(induction)
        opt.zero_grad(set_to_none=True)
        (loss if aux is None else loss + args.aux_weight * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            log.append({"step": step, "seconds": round(time.perf_counter() - start, 1), "seq_len": seq_len,
                        "loss": round(loss.item(), 4), "aux_loss": None if aux is None else round(aux.item(), 4),
                        "lr": lr})
            print(f"step {step} {log[-1]['seconds']:.0f}s len {seq_len} loss {loss.item():.3f} aux "
                  f"{log[-1]['aux_loss']} lr {lr:.2e}", flush=True)
        if step % (100 if phase == 0 else 200) == 0:  # a glance at recall while training: lower-case keys at 3/4 of the current length, 4 trials
            model.eval()
            acc = recall_probe(model, held_bytes, alphabet=PROBE_ALPHABETS["lower"], key_len=12,
                               distance=3 * seq_len // 4, filler=None, seq_len=seq_len, trials=4, seed=step)
            log[-1]["recall_3/4"] = round(acc, 3)
            print(f"  recall at {3 * seq_len // 4} bytes: {acc:.3f}", flush=True)
    train_seconds = time.perf_counter() - start
    model.config._attn_implementation = "sdpa"  # what a loader gets: the recording function is training-only
    model.eval()
    held_ids = torch.tensor(list(held_bytes), dtype=torch.long)
    ppl, windows = perplexity(model, held_ids, SEQ_LEN)
    ppl_256, windows_256 = perplexity(model, held_ids[: 64 * 256], 256, batch=16)
    probe_acc = probes(model, held_bytes, SEQ_LEN, args.probe_trials)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.to("cpu").save_pretrained(out, safe_serialization=True)
    byte_tokenizer().save_pretrained(out)
    (out / "heldout.txt").write_text(held_text, encoding="utf-8")
    command = "python benchmarks/train_recall_lm.py " + " ".join(sys.argv[1:] if argv is None else argv)
    info = {
        "command": command,
        "corpus": f"pydoc_data.topics and standard-library docstrings of Python {sys.version.split()[0]} "
                  "(Python reference manual and library text, PSF License Version 2), with synthetic recall "
                  "(random keys repeated, text spans repeated, key-value lists queried, pass keys in filler)",
        "held_out": f"every {HELD_OUT_EVERY}th pydoc topic and every {HELD_OUT_EVERY}th docstring module "
                    "in sorted order (heldout.txt)",
        "train_bytes": len(train_bytes), "held_out_bytes": len(held_bytes), "seq_len": SEQ_LEN,
        "phases": [{"steps": k, "seq_len": n, "batch": b} for k, (_, n, b) in zip(taken, phases)],
        "size": args.size or ("cpu" if not args.init else earlier.get("size", "cpu")),
        "device": str(device) if device.type == "cpu" else f"{device} ({_device_name(device)})",
        "minutes": args.minutes,
        "attention_supervision": {"weight": args.aux_weight, "heads": {f"layer {k[0]}, query head {k[1]}": v
                                                                        for k, v in AUX_HEADS.items()},
                                  "repeat_contexts": list(REPEAT_CONTEXTS)},
        "steps": step, "train_seconds": round(train_seconds, 1), "threads": args.threads,
        "held_out_perplexity": ppl, "held_out_windows": windows,
        "held_out_perplexity_256": ppl_256, "held_out_windows_256": windows_256,
        "recall_probes": {
            "what": "teacher-forced accuracy on bytes 2..n of a key's second copy, by distance (bytes) between "
                    "the copies; formats never drawn in training (key lengths 12/20, upper-case-only and Greek "
                    "alphabets, a filler text of its own), context held-out text unless '_filler'",
            "trials_per_cell": args.probe_trials, "chance_upper": 1 / 26, "accuracy": probe_acc},
        "log": log,
    }
    if earlier:  # a continuation: the whole history, and the time of both runs
        info["phases"] = earlier["phases"] + info["phases"]
        info["steps"] += earlier["steps"]
        info["train_seconds"] = round(earlier["train_seconds"] + train_seconds, 1)
        info["runs"] = earlier.get("runs", [{"steps": earlier["steps"], "train_seconds": earlier["train_seconds"],
                                             "threads": earlier["threads"], "command": earlier.get("command")}])
        info["runs"].append({"steps": step, "train_seconds": round(train_seconds, 1), "threads": args.threads,
                             "lr": args.lr, "command": command, "continued_from": "the run above"})
        info["log"] = earlier["log"] + log
    (out / "train_log.json").write_text(json.dumps(info, indent=1))
    print(json.dumps({k: v for k, v in info.items() if k != "log"}, indent=1))


if __name__ == "__main__":
    main()
