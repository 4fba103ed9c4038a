"""Text to token ids and back for the audit: the model's tokenizer, or UTF-8 bytes for a byte-level model.

Probes are assembled from token-id pieces, so every sequence has exactly the length asked for; the
codec says how a piece of text becomes ids, which ids the tokenizer puts in front of a text (a BOS),
and where a word starts (so a needle is not written into the middle of one).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

BYTE_VOCAB = 256


class ByteCodec:
    """Token id == UTF-8 byte value: a byte-level model with no tokenizer."""

    name = "UTF-8 bytes"
    byte_level = True
    prefix: tuple = ()
    pad_id = 0
    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def starts_word(self, ids: Sequence[int], i: int) -> bool:
        return i == 0 or ids[i - 1] in (0x20, 0x0A)


class TokenizerCodec:
    """A transformers tokenizer (anything with `encode` and `decode`)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
        plain = self.encode("a")
        with_specials = _ids(tokenizer, "a", add_special_tokens=True)
        # Leading special tokens the tokenizer adds to a whole text (a BOS, BERT's [CLS]), written once per
        # sequence; trailing ones ([SEP], an EOS) are not, since the text goes on.
        lead = next((k for k in range(len(with_specials)) if with_specials[k : k + len(plain)] == plain), 0)
        self.prefix = tuple(with_specials[:lead])
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(tokenizer, "eos_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        self.vocab_size = len(tokenizer) if hasattr(tokenizer, "__len__") else getattr(tokenizer, "vocab_size", None)
        # A tokenizer whose ids are bytes (as recall_lm's): answers compare token for token.
        self.byte_level = self.vocab_size == BYTE_VOCAB and self.encode("aé") == list("aé".encode("utf-8"))
        if self.byte_level:
            self.name = f"UTF-8 bytes (tokenizer {self.name})"

    def encode(self, text: str) -> list[int]:
        return _ids(self.tokenizer, text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def starts_word(self, ids: Sequence[int], i: int) -> bool:
        if i == 0:
            return True
        prev = self.decode(ids[i - 1 : i])
        both = self.decode(ids[i - 1 : i + 1])
        return prev[-1:].isspace() or both[len(prev) :][:1].isspace()


def _ids(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    # verbose=False: the whole haystack text is longer than model_max_length, and is cut into rows after
    try:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens, verbose=False))
    except TypeError:  # a tokenizer without transformers' keywords
        return list(tokenizer.encode(text))


def codec_for(tokenizer: Optional[Any], vocab: Optional[int]):
    """The codec for a model with output vocabulary `vocab` (None: unknown) and `tokenizer` (None: bytes)."""
    if tokenizer is None:
        if vocab != BYTE_VOCAB:
            raise ValueError(f"tokenizer=None reads text as UTF-8 bytes, which needs a byte-level model (vocabulary "
                             f"{BYTE_VOCAB}); this model's vocabulary is {vocab}: pass its tokenizer "
                             "(tokenizer=AutoTokenizer.from_pretrained(...))")
        return ByteCodec()
    if not callable(getattr(tokenizer, "decode", None)) or not callable(getattr(tokenizer, "encode", None)):
        raise ValueError(f"tokenizer must have encode/decode (a transformers tokenizer); got {type(tokenizer).__name__}")
    codec = TokenizerCodec(tokenizer)
    highest = max(codec.encode("The quick brown fox, 0123456789."), default=0)
    if vocab is not None and highest >= vocab:
        raise ValueError(f"the tokenizer ({codec.name}) gives token id {highest}, beyond the model's vocabulary of "
                         f"{vocab}; pass the model's own tokenizer")
    return codec
