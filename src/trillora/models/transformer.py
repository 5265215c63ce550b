"""The decoder-only transformer both families share: embeddings, pre-norm blocks, final norm, head.

Module and parameter names follow the Hugging Face checkpoints
(`model.layers.{i}.self_attn.q_proj.weight`, `model.layers.{i}.mlp.experts.gate_up_proj`, ...),
so loading is a rename-free copy and adapters export under the names vLLM and PEFT expect.
A family file only says which attention and which MLP each layer gets.

Shape legend: B batch, T tokens, C hidden channels, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .args import ModelArgs
from .attention import GQAttention, MLAttention, causal_mask
from .kv_cache import KVCache
from .layers import RMSNorm, RotaryEmbedding, SwiGLU
from .moe import MoE, SigmoidRouter


class OtherStage(nn.Module):
    """Stands where a module of another pipeline stage was (names and indices of the rest stay)."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module lives on another pipeline stage; run the model through its stages")


def keep_stage(model: nn.Module, layers, embed: bool | None = None, head: bool | None = None) -> None:
    """Drop what a pipeline rank does not run: the decoder layers outside `layers` (a range, or a set
    for a rank with several stages), the embedding unless `embed`, the final norm and head unless
    `head`. For a range they default to whether it starts at layer 0 / ends at the last layer."""
    n = len(model.model.layers)
    embed = layers.start == 0 if embed is None else embed
    head = layers.stop == n if head is None else head
    for i in range(n):
        if i not in layers:
            model.model.layers[i] = OtherStage()
    if not embed:
        model.model.embed_tokens = OtherStage()
    if not head:
        model.model.norm, model.lm_head = OtherStage(), OtherStage()


def positions_of(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, offset: int) -> torch.Tensor:
    """Position ids [B, T] of tokens that follow `offset` cached ones; with left padding
    (`attention_mask` over cached + new) counted from each row's first real token."""
    b, t = input_ids.shape
    if attention_mask is None:
        return torch.arange(offset, offset + t, device=input_ids.device).expand(b, t)
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, offset:]


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, attention: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
        index: int = 0,
    ):
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, cache, index)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs, make_layer: Callable[[int], DecoderLayer], rope_dim: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args.rope, rope_dim)
        self.windows = [args.window(i) for i in range(args.num_layers)]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        b, t = input_ids.shape
        offset = cache.length if cache is not None else 0
        if position_ids is None:
            position_ids = positions_of(input_ids, attention_mask, offset)
        x = self.embed_tokens(input_ids)  # [B, T, C]
        rope = self.rotary_emb(position_ids, x.dtype)
        # one mask per window size in use (gpt-oss alternates sliding and full layers)
        masks = {w: causal_mask(attention_mask, t, offset, x.device, w) for w in set(self.windows)}
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, masks[self.windows[i]], cache, i)
        if cache is not None:
            cache.advance(t)
        return self.norm(x)


class CausalLM(nn.Module):
    """`model(input_ids) -> logits [B, T, V]`; `model.args` is the normalised architecture."""

    def __init__(self, args: ModelArgs, make_layer: Callable[[int], DecoderLayer], rope_dim: int):
        super().__init__()
        self.args = args
        self.model = Backbone(args, make_layer, rope_dim)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def config(self) -> ModelArgs:
        return self.args

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [B, T, C]: lets callers project to the vocabulary in chunks.

        With a `cache`, `input_ids` are the new tokens only and `attention_mask` covers cached + new."""
        return self.model(input_ids, attention_mask, position_ids, cache)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Logits [B, T, V], or of the last `logits_to_keep` positions (decoding reads only the last)."""
        h = self.hidden_states(input_ids, attention_mask, position_ids, cache)
        return self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random weights (normal, std) for linear and expert weights, ones for norms, zero biases."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=generator)
        for m in self.modules():
            if isinstance(m, SigmoidRouter):
                m.e_score_correction_bias.zero_()
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Recompute derived (non-persistent) buffers, e.g. after materialising from the meta device."""
        self.model.rotary_emb.reset_parameters()

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]


def build(args: ModelArgs) -> CausalLM:
    """The usual decoder (Qwen3-MoE, GLM-4.5, DeepSeek-V3 and Kimi K2): GQA, or MLA where the config
    has a kv LoRA rank; a MoE on the layers `args.moe_layers` names, a dense SwiGLU on the rest. A
    family whose layers differ (gpt-oss) writes its own `build`."""

    def layer(i: int) -> DecoderLayer:
        mlp = MoE(args) if args.is_moe_layer(i) else SwiGLU(args.hidden_size, args.intermediate_size)
        return DecoderLayer(args, (MLAttention if args.kv_lora_rank else GQAttention)(args), mlp)

    return CausalLM(args, layer, rope_dim=args.rope_dim)
