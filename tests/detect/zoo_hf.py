"""Tiny Hugging Face models built from configs with random, seeded weights, for detection tests.

Every model uses the same pairwise-distinct sizes so that a detector which swaps two axes reports a
wrong number instead of a lucky right one: B=4 batch, H=6 query heads, D=8 head dim (hidden 48),
Hkv=2 or 3 key/value heads, N=11 tokens (7 on the decoder side of encoder-decoder models).

Each factory returns a `ZooModel`: the model in eval mode, example inputs, and the facts a correct
detector must report, written down from the config (never from a detector's output).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import transformers

B = 4  # batch (not 2 or 3, so it never equals a key/value head count)
H = 6  # query heads
D = 8  # head dim
HIDDEN = H * D  # 48
N = 11  # tokens (encoder side)
N_DEC = 7  # decoder tokens for encoder-decoder models: cross-attention has q_len 7, kv_len 11
VOCAB = 100
LAYERS = 2
FFN = 64
SEED = 0


@dataclass(frozen=True)
class ExpectedSite:
    """What one attention site must look like; `None` means "not asserted" for that field."""

    module_path: str
    layer: Optional[int]
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    scale: float
    causal: Optional[bool]  # None: the model is causal but proving it is not required (see caller)
    window: Optional[int] = None
    arbitrary_mask: Optional[bool] = None  # True: an additive bias (e.g. T5 relative positions)
    padding: Optional[bool] = None  # True: an attention_mask input with padded keys


@dataclass
class ZooModel:
    """A model, the inputs it is inspected with, and the sites a correct detector must find."""

    name: str
    model: torch.nn.Module
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)
    expected: list[ExpectedSite] = field(default_factory=list)

    @property
    def source(self) -> str:
        """"sdpa" when the config routes attention through SDPA, else "explicit" (eager chain)."""
        return "sdpa" if self.model.config._attn_implementation == "sdpa" else "explicit"


def _token_ids(n: int, seed: int) -> torch.Tensor:
    """Random ids in [1, VOCAB) so no id collides with a pad token 0 that could add a padding mask."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (B, n), generator=gen)


def _build(model_cls, config, attn_implementation: Optional[str] = None) -> torch.nn.Module:
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    torch.manual_seed(SEED)
    model = model_cls(config)
    return model.eval()


def _decoder_only(
    name: str,
    model_cls,
    config,
    path_fmt: str,
    kv_heads: int,
    windows: list[Optional[int]],
    scales: Optional[list[float]] = None,
    attn_implementation: Optional[str] = None,
) -> ZooModel:
    """A causal LM whose every layer is one causal self-attention site of N tokens."""
    model = _build(model_cls, config, attn_implementation)
    scales = scales or [D**-0.5] * LAYERS
    expected = [
        ExpectedSite(
            module_path=path_fmt.format(i),
            layer=i,
            heads=H,
            kv_heads=kv_heads,
            q_len=N,
            kv_len=N,
            head_dim=D,
            scale=scales[i],
            causal=True,
            window=windows[i],
        )
        for i in range(LAYERS)
    ]
    return ZooModel(name, model, (_token_ids(N, 1),), {"use_cache": False}, expected)


def llama(attn_implementation: Optional[str] = None) -> ZooModel:
    """Llama with GQA: 6 query heads share 2 key/value heads (repeat_kv in the eager path)."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=H,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return _decoder_only(
        f"llama-{attn_implementation or 'default'}",
        transformers.LlamaForCausalLM,
        config,
        "model.layers.{}.self_attn",
        2,
        [None, None],
        attn_implementation=attn_implementation,
    )


def mistral() -> ZooModel:
    """Mistral: a sliding window of 4 keys (incl. self) on every layer, with 3 key/value heads."""
    config = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=H,
        num_key_value_heads=3,
        head_dim=D,
        max_position_embeddings=64,
        sliding_window=4,
    )
    return _decoder_only(
        "mistral", transformers.MistralForCausalLM, config, "model.layers.{}.self_attn", 3, [4, 4]
    )


def qwen2() -> ZooModel:
    """Qwen2: GQA with biased q/k/v projections, no sliding window."""
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=H,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_sliding_window=False,
    )
    return _decoder_only(
        "qwen2", transformers.Qwen2ForCausalLM, config, "model.layers.{}.self_attn", 2, [None, None]
    )


def phi3() -> ZooModel:
    """Phi-3: q, k and v come out of one fused qkv Linear and are sliced apart."""
    config = transformers.Phi3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=H,
        num_key_value_heads=3,
        max_position_embeddings=64,
        original_max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _decoder_only(
        "phi3", transformers.Phi3ForCausalLM, config, "model.layers.{}.self_attn", 3, [None, None]
    )


def gemma2(softcap: Optional[float] = None) -> ZooModel:
    """Gemma-2: layer 0 local (window 4), layer 1 global; scale from query_pre_attn_scalar=16.

    With `softcap` set the logits pass through tanh before softmax, which is not plain softmax
    attention; the site expectations below are for the softcap-free model.
    """
    config = transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=H,
        num_key_value_heads=2,
        head_dim=D,
        max_position_embeddings=64,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,  # scale 16**-0.5 = 0.25, distinct from 1/sqrt(D)
        attn_logit_softcapping=softcap,
        final_logit_softcapping=None,
    )
    zoo = _decoder_only(
        "gemma2",
        transformers.Gemma2ForCausalLM,
        config,
        "model.layers.{}.self_attn",
        2,
        [4, None],
        scales=[0.25, 0.25],
        attn_implementation="eager",
    )
    return zoo


def gpt2(attn_implementation: str, inverse_layer_scale: bool = False) -> ZooModel:
    """GPT-2 (MHA, fused c_attn); with `inverse_layer_scale` layer i is scaled by 1/(sqrt(D)(i+1))."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=H,
        n_positions=64,
        n_inner=FFN,
        bos_token_id=1,
        eos_token_id=2,
        scale_attn_by_inverse_layer_idx=inverse_layer_scale,
    )
    scales = [D**-0.5 / (i + 1) if inverse_layer_scale else D**-0.5 for i in range(LAYERS)]
    return _decoder_only(
        f"gpt2-{attn_implementation}",
        transformers.GPT2LMHeadModel,
        config,
        "transformer.h.{}.attn",
        H,
        [None, None],
        scales=scales,
        attn_implementation=attn_implementation,
    )


def padding_mask_BN() -> torch.Tensor:
    """attention_mask [B, N]: 1 keeps a token; the second sequence has its last 3 tokens padded."""
    keep = torch.ones(B, N, dtype=torch.long)
    keep[1, N - 3 :] = 0
    return keep


def with_padding(zoo: ZooModel) -> ZooModel:
    """The same model called with a padded attention_mask: every self-attention site now also
    carries a per-(batch, key) padding pattern, on top of whatever causality it had."""
    expected = [dataclasses.replace(e, padding=True, arbitrary_mask=False) for e in zoo.expected]
    kwargs = {**zoo.kwargs, "attention_mask": padding_mask_BN()}
    return ZooModel(f"{zoo.name}-padded", zoo.model, zoo.args, kwargs, expected)


def bert() -> ZooModel:
    """BERT encoder: bidirectional self-attention, no mask passed (so none to honour)."""
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=H,
        intermediate_size=FFN,
        max_position_embeddings=64,
    )
    model = _build(transformers.BertModel, config)
    expected = [
        ExpectedSite(f"encoder.layer.{i}.attention.self", i, H, H, N, N, D, D**-0.5, False)
        for i in range(LAYERS)
    ]
    return ZooModel("bert", model, (_token_ids(N, 2),), {}, expected)


VIT_TOKENS = 17  # (16 / 4)**2 patches + [CLS]


def vit() -> ZooModel:
    """ViT: 16x16 image, 4x4 patches -> 17 tokens, bidirectional."""
    config = transformers.ViTConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=H,
        intermediate_size=FFN,
        image_size=16,
        patch_size=4,
        num_channels=3,
    )
    model = _build(transformers.ViTModel, config)
    gen = torch.Generator().manual_seed(3)
    pixels = torch.randn(B, 3, 16, 16, generator=gen)
    expected = [
        ExpectedSite(
            f"layers.{i}.attention", i, H, H, VIT_TOKENS, VIT_TOKENS, D, D**-0.5, False
        )
        for i in range(LAYERS)
    ]
    return ZooModel("vit", model, (pixels,), {}, expected)


def _encoder_decoder_layers(i: int) -> tuple[int, int, int]:
    """Residual-stream order of block i's (encoder self, decoder self, cross) sites.

    `layer` counts the longest chain of earlier sites feeding a site: the encoder runs 0, 1, ...;
    decoder self-attention 0 sees no site (0); cross-attention i sits after the whole encoder and
    decoder self-attention i, decoder self-attention i+1 after cross-attention i.
    """
    enc = i
    cross = LAYERS + 2 * i
    dec_self = 0 if i == 0 else cross - 1
    return enc, dec_self, cross


def bart() -> ZooModel:
    """BART: encoder self (11 tokens), decoder self (7, causal) and cross attention (7 over 11)."""
    config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=H,
        decoder_attention_heads=H,
        encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN,
        max_position_embeddings=64,
    )
    model = _build(transformers.BartModel, config)
    scale = D**-0.5
    expected = []
    for i in range(LAYERS):
        enc, dec_self, cross = _encoder_decoder_layers(i)
        expected.append(ExpectedSite(f"encoder.layers.{i}.self_attn", enc, H, H, N, N, D, scale, False))
        expected.append(
            ExpectedSite(f"decoder.layers.{i}.self_attn", dec_self, H, H, N_DEC, N_DEC, D, scale, True)
        )
        expected.append(
            ExpectedSite(f"decoder.layers.{i}.encoder_attn", cross, H, H, N_DEC, N, D, scale, False)
        )
    kwargs = {"decoder_input_ids": _token_ids(N_DEC, 5), "use_cache": False}
    return ZooModel("bart", model, (_token_ids(N, 4),), kwargs, expected)


def t5() -> ZooModel:
    """T5: no 1/sqrt(D) scaling (scale 1.0) and a relative position bias added to the logits.

    The bias makes encoder and decoder self-attention masks arbitrary; whether the decoder's causal
    part is also proven under the bias is left open (causal=None), cross-attention is not causal.
    """
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        d_kv=D,
        d_ff=FFN,
        num_layers=LAYERS,
        num_decoder_layers=LAYERS,
        num_heads=H,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
    )
    model = _build(transformers.T5Model, config)
    expected = []
    for i in range(LAYERS):
        enc, dec_self, cross = _encoder_decoder_layers(i)
        expected.append(
            ExpectedSite(f"encoder.block.{i}.layer.0.SelfAttention", enc, H, H, N, N, D, 1.0, False, None, True)
        )
        expected.append(
            ExpectedSite(
                f"decoder.block.{i}.layer.0.SelfAttention", dec_self, H, H, N_DEC, N_DEC, D, 1.0, None, None, True
            )
        )
        expected.append(
            ExpectedSite(f"decoder.block.{i}.layer.1.EncDecAttention", cross, H, H, N_DEC, N, D, 1.0, False)
        )
    kwargs = {"decoder_input_ids": _token_ids(N_DEC, 7), "use_cache": False}
    return ZooModel("t5", model, (_token_ids(N, 6),), kwargs, expected)


FACTORIES = {
    "llama": llama,
    "llama-eager": lambda: llama("eager"),
    "mistral": mistral,
    "qwen2": qwen2,
    "phi3": phi3,
    "gemma2": gemma2,
    "gpt2-eager": lambda: gpt2("eager"),
    "gpt2-sdpa": lambda: gpt2("sdpa"),
    "gpt2-inverse-layer-scale": lambda: gpt2("eager", inverse_layer_scale=True),
    "bert": bert,
    "vit": vit,
    "bart": bart,
    "t5": t5,
    "bert-padded": lambda: with_padding(bert()),
    "llama-padded": lambda: with_padding(llama()),
}
