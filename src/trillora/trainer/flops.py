"""FLOPs of an RL run, counted from the model's shape and the tokens that actually ran.

Compute-matched comparisons (a larger model with LoRA against a smaller one trained in full)
need one currency for sampling and training. The counts are model FLOPs, like MFU's numerator:
2 per weight of every matrix a token multiplies through (routed experts: top_k of E; LoRA's A
and B included; the embedding is a lookup; norms and activations are left out) plus causal
attention, 2·H·(D_qk + D_v) per layer for each (query, key) pair, L·(L+1)/2 pairs in a row of L
tokens. Not counted: recomputation under activation checkpointing, padding, the prompt shared
across a group (`parallel.share_prompts`) counted as if every row ran it, prefix caches, and
evaluation.

    sampling   a call with a P-token prompt that writes G tokens feeds P + G - 1 positions through
               the body and the LM head at the G positions a token is drawn from
    forward    every position through body and head (logprobs are needed at each one)
    backward   the input gradient costs a forward again; weight gradients another forward's worth,
               but only for trained weights (the adapters under LoRA, everything in full training);
               attention's backward is two forwards
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..plan.flops import attention_width


@dataclass(frozen=True)
class ModelFlops:
    """Per-token weight FLOPs of one model as trained, and attention's cost per (query, key) pair."""

    frozen: float  # 2 × frozen matrix weights a token goes through, the head included
    trained: float  # 2 × trained matrix weights a token goes through (adapters under LoRA)
    head: float  # 2 × the LM head's weights (part of `frozen` or `trained`)
    adapter: float  # 2 × LoRA weights a token goes through (part of `trained`; off in a reference pass)
    attention: float  # 2·layers·H·(D_qk + D_v): all layers' FLOPs for one (query, key) pair
    windows: tuple[int, ...] = ()  # per layer, gpt-oss's sliding windows (0 = full); () = all full

    @classmethod
    def of(cls, model: nn.Module) -> ModelFlops:
        """Counted on the unsharded model with its adapters applied (any device, meta included)."""
        from ..models.moe import GroupedExperts

        a = model.args
        experts = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        frozen = trained = adapter = 0.0
        for name, p in model.named_parameters():
            if p.dim() < 2 or p is embed and p is not head:  # a lookup (tied: counted once, as the head)
                continue
            n = p.numel() * (a.top_k / a.num_experts if id(p) in experts else 1.0)
            lora = name.rpartition(".")[2].startswith("lora_")
            adapter += 2 * n if lora else 0.0
            if p.requires_grad:
                trained += 2 * n
            else:
                frozen += 2 * n
        return cls(
            frozen,
            trained,
            2 * head.numel(),
            adapter,
            2 * a.num_layers * a.num_heads * attention_width(a),
            tuple(a.layer_windows),
        )

    @property
    def weights(self) -> float:
        return self.frozen + self.trained

    def sample(self, prompt: int, new: int) -> float:
        """One engine call: a `prompt`-token context, `new` tokens written."""
        fed = max(prompt + new - 1, 0)
        return (self.weights - self.head) * fed + self.head * new + self.attend(fed)

    def forward(self, length: int, adapters: bool = True) -> float:
        """One row of `length` tokens through the model (`adapters=False`: the reference pass)."""
        weights = self.weights if adapters else self.weights - self.adapter
        return weights * length + self.attend(length)

    def backward(self, length: int) -> float:
        return (self.weights + self.trained) * length + 2 * self.attend(length)

    def attend(self, length: int) -> float:
        """Attention over a row of `length` tokens in all layers (a windowed layer sees fewer pairs)."""
        if not any(self.windows):
            return self.attention * pairs(length)
        return self.attention / len(self.windows) * sum(pairs(length, w) for w in self.windows)

    def train_step(self, lengths: list[int], epochs: int, proximal: bool, reference: bool) -> float:
        """A policy update over rows of `lengths`: forward + backward of every row once per epoch
        (its minibatches split the rows), plus the no-grad passes before: the proximal policy's
        logprobs when the policy moves within the batch, the reference's with a KL term."""
        once = sum(self.forward(n) + self.backward(n) for n in lengths) * epochs
        return (
            once
            + sum(self.forward(n) for n in lengths) * proximal
            + sum(self.forward(n, adapters=False) for n in lengths) * reference
        )


def pairs(length: int, window: int = 0) -> int:
    """Causal (query, key) pairs of a row: each position attends to itself and everything before
    (under a sliding window, to itself and the window - 1 before)."""
    if not window or length <= window:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def rollout_flops(model: ModelFlops, groups) -> float:
    """Every engine call of some trajectory groups (turns, refills and summaries alike) and the
    forwards a memory ran to score chunks (`memory_scoring_flops`, counted where they ran)."""
    return sum(
        model.sample(len(x.observation), len(x.action)) + x.metrics.get("memory_scoring_flops", 0.0)
        for g in groups
        for t in g.trajectories
        for x in t.transitions
    )
