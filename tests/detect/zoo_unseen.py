"""A second zoo of tiny random-weight models, of architectures the detector was not written against.

Same pairwise-distinct sizes as `zoo_hf` (B=4 batch, H=6 query heads, D=8 head dim, Hkv=2 or 3,
N=11 tokens, 7 on decoder sides), so a swapped axis gives a wrong number. Every expectation is
written from the config (heads, kv heads, causality, window, whether a bias makes the mask
arbitrary), never copied from what the detector printed.

`UnseenCase.sites` lists the sites a correct detector must report, `UnseenCase.misses` the
softmaxes that must be near misses (MoE routers), by module path and allowed reason codes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import transformers
from torch import nn

from zoo_hf import B, D, FFN, H, HIDDEN, LAYERS, N, N_DEC, SEED, VOCAB, _encoder_decoder_layers, _token_ids


@dataclass(frozen=True)
class Want:
    """One site as the config says it must be; `None` fields are not asserted."""

    module_path: str
    heads: int = H
    kv_heads: int = H
    q_len: int = N
    kv_len: int = N
    head_dim: int = D
    scale: float = D**-0.5
    causal: bool = False
    window: Optional[int] = None
    arbitrary: bool = False
    padding: bool = False
    batch: int = B
    layer: Optional[int] = None


@dataclass(frozen=True)
class WantMiss:
    """A softmax that must be reported as a near miss (never a site) in `module_path`."""

    module_path: str
    codes: tuple


@dataclass
class UnseenCase:
    name: str
    model: nn.Module
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)
    sites: list[Want] = field(default_factory=list)
    misses: list[WantMiss] = field(default_factory=list)


def _build(model_cls, config, attn_implementation: Optional[str] = None) -> nn.Module:
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    torch.manual_seed(SEED)
    return model_cls(config).eval()


def _causal_lm(name, model_cls, config, kv_heads, windows=None, scale=D**-0.5, path="model.layers.{}.self_attn",
               attn_implementation=None, head_dim=D, heads=H, arbitrary=False, causal=True,
               misses: Callable[[int], list] = lambda i: []) -> UnseenCase:
    """A decoder-only LM called with use_cache=False: each layer is one self-attention site over N."""
    model = _build(model_cls, config, attn_implementation)
    windows = windows or [None] * LAYERS
    sites = [Want(path.format(i), heads=heads, kv_heads=kv_heads, head_dim=head_dim, scale=scale, causal=causal,
                  window=windows[i], arbitrary=arbitrary, layer=i) for i in range(LAYERS)]
    wanted_misses = [m for i in range(LAYERS) for m in misses(i)]
    return UnseenCase(name, model, (_token_ids(N, 11),), {"use_cache": False}, sites, wanted_misses)


_LM = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
           num_attention_heads=H, max_position_embeddings=64)


# ---- decoder-only LMs -----------------------------------------------------------------------------

def qwen3() -> UnseenCase:
    """Qwen3: per-head q/k RMSNorm before RoPE, GQA 6/2."""
    config = transformers.Qwen3Config(**_LM, num_key_value_heads=2, head_dim=D)
    return _causal_lm("qwen3", transformers.Qwen3ForCausalLM, config, 2)


def gemma() -> UnseenCase:
    """Gemma 1: GQA 6/3, explicit head_dim, scale 1/sqrt(D)."""
    config = transformers.GemmaConfig(**_LM, num_key_value_heads=3, head_dim=D)
    return _causal_lm("gemma", transformers.GemmaForCausalLM, config, 3)


def gemma3() -> UnseenCase:
    """Gemma 3 text: layer 0 local (window 4), layer 1 global; scale query_pre_attn_scalar**-0.5."""
    config = transformers.Gemma3TextConfig(**_LM, num_key_value_heads=2, head_dim=D, sliding_window=4,
                                           layer_types=["sliding_attention", "full_attention"],
                                           query_pre_attn_scalar=16, attn_logit_softcapping=None,
                                           final_logit_softcapping=None)
    return _causal_lm("gemma3", transformers.Gemma3ForCausalLM, config, 2, windows=[4, None], scale=0.25)


def olmo() -> UnseenCase:
    config = transformers.OlmoConfig(**_LM, num_key_value_heads=3)
    return _causal_lm("olmo", transformers.OlmoForCausalLM, config, 3)


def olmo2() -> UnseenCase:
    """OLMo-2: RMSNorm over the whole q / k projections (before the head split)."""
    config = transformers.Olmo2Config(**_LM, num_key_value_heads=2)
    return _causal_lm("olmo2", transformers.Olmo2ForCausalLM, config, 2)


def falcon(alibi: bool = False) -> UnseenCase:
    """Falcon, new decoder architecture: the config has 2 key/value heads for 6 query heads.

    Where Falcon calls SDPA itself (transformers before the 5.x releases that route it through the
    attention interface) it repeats k and v with `broadcast_to` in the [B, N, Hkv, G, D] layout
    BEFORE RoPE and the head transpose, so no [B, 2, N, D] key exists anywhere in the graph for a
    site to name; the site reports the 6 heads it is actually handed (a rewrite on them is exact, it
    only forgoes the GQA memory saving). Through the interface it hands over the 2 kv heads. With
    ALiBi the mask is the causal mask plus a per-head linear bias: causal (proven from positions)
    and arbitrary (only exact honours it)."""
    import inspect

    from transformers.models.falcon.modeling_falcon import FalconAttention

    kv_heads = 2 if "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(FalconAttention.forward) else H
    config = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                       num_attention_heads=H, num_kv_heads=2, new_decoder_architecture=True,
                                       alibi=alibi, max_position_embeddings=64)
    return _causal_lm("falcon-alibi" if alibi else "falcon", transformers.FalconForCausalLM, config, kv_heads,
                      path="transformer.h.{}.self_attention", arbitrary=alibi)


def falcon_mqa() -> UnseenCase:
    """Falcon-7B style: multi-query attention, one key/value head shared by all 6 query heads."""
    config = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                       num_attention_heads=H, multi_query=True, new_decoder_architecture=False,
                                       max_position_embeddings=64)
    return _causal_lm("falcon-mqa", transformers.FalconForCausalLM, config, 1, path="transformer.h.{}.self_attention")


def gpt_neox() -> UnseenCase:
    config = transformers.GPTNeoXConfig(**_LM)
    return _causal_lm("gpt-neox", transformers.GPTNeoXForCausalLM, config, H, path="gpt_neox.layers.{}.attention")


def gptj() -> UnseenCase:
    """GPT-J: partial rotary on q/k, scores computed in fp32 and divided by sqrt(D)."""
    config = transformers.GPTJConfig(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=H, rotary_dim=4,
                                     n_positions=64, n_inner=FFN)
    return _causal_lm("gptj", transformers.GPTJForCausalLM, config, H, path="transformer.h.{}.attn")


def opt() -> UnseenCase:
    """OPT multiplies q by 1/sqrt(D) right after q_proj, in [B, N, H*D], then calls SDPA with
    scale=1. The site's query node is that already scaled q (no unscaled [B, H, N, D] q exists), so
    its scale is 1.0 relative to it -- reporting 1/sqrt(D) would scale twice in a rewrite. The
    spelling tag `scale:folded_into_query` says where the config's 1/sqrt(D) went."""
    config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                    num_attention_heads=H, ffn_dim=FFN, max_position_embeddings=64,
                                    word_embed_proj_dim=HIDDEN)
    return _causal_lm("opt", transformers.OPTForCausalLM, config, H, path="model.decoder.layers.{}.self_attn",
                      scale=1.0)


def bloom() -> UnseenCase:
    """BLOOM: ALiBi enters as baddbmm's bias, the causal mask as a second additive term. The finite
    per-head bias makes the mask arbitrary (never causal-only); the keys it hides are the causal
    ones, built from positions, so causal is True as well."""
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=H)
    return _causal_lm("bloom", transformers.BloomForCausalLM, config, H, path="transformer.h.{}.self_attention",
                      arbitrary=True)


def mpt() -> UnseenCase:
    """MPT: ALiBi on by default (arbitrary additive bias) plus a causal masked_fill: arbitrary and causal."""
    config = transformers.MptConfig(vocab_size=VOCAB, d_model=HIDDEN, n_heads=H, n_layers=LAYERS, max_seq_len=64,
                                    expansion_ratio=2)
    return _causal_lm("mpt", transformers.MptForCausalLM, config, H, path="transformer.blocks.{}.attn", arbitrary=True)


def stablelm() -> UnseenCase:
    """StableLM: partial rotary (25 % of D), GQA 6/2."""
    config = transformers.StableLmConfig(**_LM, num_key_value_heads=2)
    return _causal_lm("stablelm", transformers.StableLmForCausalLM, config, 2)


def phi() -> UnseenCase:
    """Phi-1/2: partial rotary, dense output projection, MHA."""
    config = transformers.PhiConfig(**_LM)
    return _causal_lm("phi", transformers.PhiForCausalLM, config, H)


def starcoder2() -> UnseenCase:
    """Starcoder2: sliding window 4 on every layer, GQA 6/2."""
    config = transformers.Starcoder2Config(**_LM, num_key_value_heads=2, sliding_window=4)
    return _causal_lm("starcoder2", transformers.Starcoder2ForCausalLM, config, 2, windows=[4, 4])


def _router_miss(path: str) -> Callable[[int], list]:
    # the router's softmax is over x·W_gate (a weight, not keys): never attention
    return lambda i: [WantMiss(path.format(i), ("no_score_matmul",))]


def mixtral() -> UnseenCase:
    config = transformers.MixtralConfig(**_LM, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    return _causal_lm("mixtral", transformers.MixtralForCausalLM, config, 2,
                      misses=_router_miss("model.layers.{}.mlp.gate"))


def qwen2_moe() -> UnseenCase:
    config = transformers.Qwen2MoeConfig(**_LM, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=32)
    return _causal_lm("qwen2-moe", transformers.Qwen2MoeForCausalLM, config, 2,
                      misses=_router_miss("model.layers.{}.mlp.gate"))


def olmoe() -> UnseenCase:
    config = transformers.OlmoeConfig(**_LM, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    return _causal_lm("olmoe", transformers.OlmoeForCausalLM, config, 2, misses=_router_miss("model.layers.{}.mlp.gate"))


def llama_eager_padded() -> UnseenCase:
    """Eager Llama with a padded attention_mask: causal + padding, GQA through repeat_kv."""
    from zoo_hf import padding_mask_BN

    config = transformers.LlamaConfig(**_LM, num_key_value_heads=3)
    case = _causal_lm("llama-eager-padded", transformers.LlamaForCausalLM, config, 3, attn_implementation="eager")
    case.kwargs["attention_mask"] = padding_mask_BN()
    case.sites = [Want(w.module_path, kv_heads=3, causal=True, padding=True, layer=w.layer) for w in case.sites]
    return case


# ---- encoders -------------------------------------------------------------------------------------

def _encoder(name, model, path, args, heads=H, q_len=N, scale=D**-0.5, arbitrary=False, batch=B) -> UnseenCase:
    sites = [Want(path.format(i), heads=heads, kv_heads=heads, q_len=q_len, kv_len=q_len, scale=scale,
                  arbitrary=arbitrary, batch=batch, layer=i) for i in range(LAYERS)]
    return UnseenCase(name, model, args, {}, sites)


def distilbert() -> UnseenCase:
    config = transformers.DistilBertConfig(vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=H, hidden_dim=FFN,
                                           max_position_embeddings=64)
    return _encoder("distilbert", _build(transformers.DistilBertModel, config), "transformer.layer.{}.attention",
                    (_token_ids(N, 12),))


_BERTLIKE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=H,
                 intermediate_size=FFN, max_position_embeddings=64)


def roberta() -> UnseenCase:
    config = transformers.RobertaConfig(**_BERTLIKE, pad_token_id=0)
    return _encoder("roberta", _build(transformers.RobertaModel, config), "encoder.layer.{}.attention.self",
                    (_token_ids(N, 13),))


def electra() -> UnseenCase:
    config = transformers.ElectraConfig(**_BERTLIKE, embedding_size=32)
    return _encoder("electra", _build(transformers.ElectraModel, config), "encoder.layer.{}.attention.self",
                    (_token_ids(N, 14),))


def albert() -> UnseenCase:
    """ALBERT shares one layer's weights across depth: two sites in the SAME module, layers 0 and 1."""
    config = transformers.AlbertConfig(**_BERTLIKE, embedding_size=32)
    path = "encoder.albert_layer_groups.0.albert_layers.0.attention"
    case = _encoder("albert", _build(transformers.AlbertModel, config), path, (_token_ids(N, 15),))
    return case


def deberta_v2() -> UnseenCase:
    """DeBERTa-v2 disentangled attention: scores = q·kᵀ/sqrt(3D) + c2p(q, pos) + p2c(k, pos).

    The c2p/p2c terms are computed from q and k themselves, upstream of the scores add, so the
    chain is still softmax(scale·q·kᵀ + M)·v with M a tensor the graph already holds: a site
    whose mask is arbitrary (only an exact rewrite that adds M honours it). Scale 1/sqrt(3D):
    one factor per score term (c2q, c2p, p2c).
    """
    config = transformers.DebertaV2Config(**_BERTLIKE, relative_attention=True, pos_att_type=["p2c", "c2p"],
                                          position_buckets=4, max_relative_positions=16, type_vocab_size=0)
    model = _build(transformers.DebertaV2Model, config)
    return _encoder("deberta-v2", model, "encoder.layer.{}.attention.self", (_token_ids(N, 16),),
                    scale=(3 * D) ** -0.5, arbitrary=True)


PATCHES = 4  # 16x16 image, 4x4 patches -> 16 patches


def _pixels(size: int = 16, seed: int = 17) -> torch.Tensor:
    return torch.randn(B, 3, size, size, generator=torch.Generator().manual_seed(seed))


def dinov2() -> UnseenCase:
    config = transformers.Dinov2Config(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=H,
                                       mlp_ratio=2, image_size=16, patch_size=4)
    return _encoder("dinov2", _build(transformers.Dinov2Model, config), "encoder.layer.{}.attention",
                    (_pixels(),), q_len=17)


def clip_vision() -> UnseenCase:
    config = transformers.CLIPVisionConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                           num_attention_heads=H, image_size=16, patch_size=4)
    return _encoder("clip-vision", _build(transformers.CLIPVisionModel, config),
                    "encoder.layers.{}.self_attn", (_pixels(),), q_len=17)


def clip_text() -> UnseenCase:
    """CLIP's text tower is causal although it is an encoder."""
    config = transformers.CLIPTextConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                         num_hidden_layers=LAYERS, num_attention_heads=H, max_position_embeddings=64)
    case = _encoder("clip-text", _build(transformers.CLIPTextModel, config), "encoder.layers.{}.self_attn",
                    (_token_ids(N, 18),))
    case.sites = [Want(w.module_path, causal=True, layer=w.layer) for w in case.sites]
    return case


def siglip_vision() -> UnseenCase:
    """SigLIP vision: no [CLS], 16 patch tokens, plus the attention-pooling head (1 probe query)."""
    config = transformers.SiglipVisionConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                             num_attention_heads=H, image_size=16, patch_size=4)
    case = _encoder("siglip-vision", _build(transformers.SiglipVisionModel, config),
                    "encoder.layers.{}.self_attn", (_pixels(),), q_len=16)
    # the pooling head is nn.MultiheadAttention with one learned probe query over the 16 patches
    case.sites.append(Want("head.attention", q_len=1, kv_len=16, layer=LAYERS))
    return case


def siglip_text() -> UnseenCase:
    """SigLIP's text tower is bidirectional (unlike CLIP's)."""
    config = transformers.SiglipTextConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                           num_hidden_layers=LAYERS, num_attention_heads=H, max_position_embeddings=64)
    return _encoder("siglip-text", _build(transformers.SiglipTextModel, config),
                    "encoder.layers.{}.self_attn", (_token_ids(N, 19),))


SWIN_WINDOWS = 4  # 12x12 image, 2x2 patches -> 6x6 tokens, windows of 3x3 -> 4 windows of 9 tokens


def swin() -> UnseenCase:
    """Swin: attention inside 3x3 windows (batch B * 4 windows, 9 tokens) with a learned relative
    position bias (arbitrary); block 1 shifts its windows and adds the shift mask on top."""
    config = transformers.SwinConfig(image_size=12, patch_size=2, embed_dim=HIDDEN, depths=[2], num_heads=[H],
                                     window_size=3, mlp_ratio=1.0, drop_path_rate=0.0)
    model = _build(transformers.SwinModel, config)
    with torch.no_grad():  # the bias table starts at zero; a trained one is not, and a zero bias hides nothing
        for block in model.encoder.layers[0].blocks:
            block.attention.relative_position_bias.relative_position_bias_table.normal_(0.0, 1.0,
                                                                      generator=torch.Generator().manual_seed(20))
    return _encoder("swin", model, "encoder.layers.0.blocks.{}.attention", (_pixels(12),), q_len=9,
                    arbitrary=True, batch=B * SWIN_WINDOWS)


# ---- encoder-decoders -----------------------------------------------------------------------------

MEL = 10
FRAMES = 2 * N  # Whisper's conv stem halves the frames: encoder length N


def whisper() -> UnseenCase:
    """Whisper: encoder self (N, bidirectional), decoder self (N_DEC, causal), cross (N_DEC over N).

    Like OPT, Whisper scales q by 1/sqrt(D) right after q_proj and calls SDPA with scale=1: the
    site's scale is 1.0 relative to its (already scaled) query node."""
    config = transformers.WhisperConfig(vocab_size=VOCAB, num_mel_bins=MEL, d_model=HIDDEN, encoder_layers=LAYERS,
                                        decoder_layers=LAYERS, encoder_attention_heads=H, decoder_attention_heads=H,
                                        encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, max_source_positions=N,
                                        max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                        decoder_start_token_id=1, begin_suppress_tokens=None)
    model = _build(transformers.WhisperModel, config)
    sites = []
    for i in range(LAYERS):
        enc, dec_self, cross = _encoder_decoder_layers(i)
        sites.append(Want(f"encoder.layers.{i}.self_attn", scale=1.0, layer=enc))
        sites.append(Want(f"decoder.layers.{i}.self_attn", q_len=N_DEC, kv_len=N_DEC, scale=1.0, causal=True,
                          layer=dec_self))
        sites.append(Want(f"decoder.layers.{i}.encoder_attn", q_len=N_DEC, kv_len=N, scale=1.0, layer=cross))
    features = torch.randn(B, MEL, FRAMES, generator=torch.Generator().manual_seed(21))
    kwargs = {"decoder_input_ids": _token_ids(N_DEC, 22), "use_cache": False}
    return UnseenCase("whisper", model, (features,), kwargs, sites)


class TorchTransformerMaskInput(nn.Module):
    """nn.Transformer called with the causal tgt mask as an INPUT float tensor: whatever it holds on
    the example, the next call may pass another mask, so causality must not be claimed."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED)
        self.core = nn.Transformer(d_model=HIDDEN, nhead=H, num_encoder_layers=LAYERS, num_decoder_layers=LAYERS,
                                   dim_feedforward=FFN, dropout=0.0, batch_first=True)

    def forward(self, src_BNX, tgt_BMX, tgt_mask_MM):
        return self.core(src_BNX, tgt_BMX, tgt_mask=tgt_mask_MM, tgt_is_causal=False)


class TorchTransformerMaskBuilt(TorchTransformerMaskInput):
    """The same, but the mask is built inside forward from the target length: causal is provable."""

    def forward(self, src_BNX, tgt_BMX):
        mask_MM = nn.Transformer.generate_square_subsequent_mask(tgt_BMX.shape[1], device=tgt_BMX.device)
        return self.core(src_BNX, tgt_BMX, tgt_mask=mask_MM, tgt_is_causal=False)


def _torch_transformer_sites(decoder_causal: bool, decoder_arbitrary: bool) -> list[Want]:
    sites = []
    for i in range(LAYERS):
        enc, dec_self, cross = _encoder_decoder_layers(i)
        sites.append(Want(f"core.encoder.layers.{i}.self_attn", layer=enc))
        sites.append(Want(f"core.decoder.layers.{i}.self_attn", q_len=N_DEC, kv_len=N_DEC, causal=decoder_causal,
                          arbitrary=decoder_arbitrary, layer=dec_self))
        sites.append(Want(f"core.decoder.layers.{i}.multihead_attn", q_len=N_DEC, kv_len=N, layer=cross))
    return sites


def _src_tgt() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(23)
    return torch.randn(B, N, HIDDEN, generator=gen), torch.randn(B, N_DEC, HIDDEN, generator=gen)


def torch_transformer_mask_input() -> UnseenCase:
    # an input float mask that is causal today is only "some additive bias" for the next call
    src, tgt = _src_tgt()
    mask = nn.Transformer.generate_square_subsequent_mask(N_DEC)
    return UnseenCase("nn.Transformer-mask-input", TorchTransformerMaskInput().eval(), (src, tgt, mask), {},
                      _torch_transformer_sites(decoder_causal=False, decoder_arbitrary=True))


def torch_transformer_mask_built() -> UnseenCase:
    src, tgt = _src_tgt()
    return UnseenCase("nn.Transformer-mask-built", TorchTransformerMaskBuilt().eval(), (src, tgt), {},
                      _torch_transformer_sites(decoder_causal=True, decoder_arbitrary=False))


class AlibiPlusInputMask(nn.Module):
    """ALiBi built from positions, plus an INPUT additive mask that happens to be causal on the
    example: the mask is arbitrary, and the causal look must not be vouched for by the ALiBi term's
    position-built ancestry (only the input hides keys)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)

    def forward(self, x_BNX, mask_NN):
        b, n, _ = x_BNX.shape
        q, k, v = self.qkv(x_BNX).view(b, n, 3, H, D).permute(2, 0, 3, 1, 4)
        slopes_H11 = 2.0 ** -torch.arange(1, H + 1, dtype=x_BNX.dtype)[:, None, None]
        alibi_HNN = slopes_H11 * torch.arange(n, dtype=x_BNX.dtype)[None, None, :]
        scores = (q @ k.transpose(-2, -1)) * D**-0.5 + alibi_HNN
        scores = scores + mask_NN
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, HIDDEN)


def alibi_plus_input_mask() -> UnseenCase:
    x = torch.randn(B, N, HIDDEN, generator=torch.Generator().manual_seed(24))
    mask = nn.Transformer.generate_square_subsequent_mask(N)
    return UnseenCase("alibi+input-mask", AlibiPlusInputMask().eval(), (x, mask), {},
                      [Want("", causal=False, arbitrary=True, layer=0)])


FACTORIES: dict[str, Callable[[], UnseenCase]] = {
    "qwen3": qwen3,
    "gemma": gemma,
    "gemma3": gemma3,
    "olmo": olmo,
    "olmo2": olmo2,
    "falcon": falcon,
    "falcon-mqa": falcon_mqa,
    "falcon-alibi": lambda: falcon(alibi=True),
    "gpt-neox": gpt_neox,
    "gptj": gptj,
    "opt": opt,
    "bloom": bloom,
    "mpt": mpt,
    "stablelm": stablelm,
    "phi": phi,
    "starcoder2": starcoder2,
    "mixtral": mixtral,
    "qwen2-moe": qwen2_moe,
    "olmoe": olmoe,
    "llama-eager-padded": llama_eager_padded,
    "distilbert": distilbert,
    "roberta": roberta,
    "electra": electra,
    "albert": albert,
    "deberta-v2": deberta_v2,
    "dinov2": dinov2,
    "clip-vision": clip_vision,
    "clip-text": clip_text,
    "siglip-vision": siglip_vision,
    "siglip-text": siglip_text,
    "swin": swin,
    "whisper": whisper,
    "nn.Transformer-mask-input": torch_transformer_mask_input,
    "nn.Transformer-mask-built": torch_transformer_mask_built,
    "alibi+input-mask": alibi_plus_input_mask,
}

# the same models through the eager (explicit softmax chain) attention path
EAGER_NAMES = ["gemma3", "starcoder2", "gptj", "gpt-neox", "phi", "whisper", "clip-text", "siglip-vision", "dinov2",
               "swin", "mixtral"]
