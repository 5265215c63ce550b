"""FLOPs per token of a training pass, from a `Footprint`'s counted parameters: what the planner's
step time and `benchmarks/mfu.py` divide by."""

from __future__ import annotations

from ..models.args import ModelArgs


def training_flops(fp, seq_len: int) -> dict[str, float]:
    """FLOPs per token of one training pass over rows of `seq_len` tokens, by direction, counted from
    `fp` (`cost.Footprint`: the model's args and its parameters by bucket, {(place, kind, expert,
    trained): count}).

    Forward: 2 per weight a token multiplies through (routed experts: top-k of E; LoRA's A and
    B included; the embedding is a lookup) plus causal attention, 2·(keys per query)·H·(D_qk + D_v)
    per layer: T/2 keys on average, fewer in gpt-oss's sliding-window layers.
    Backward: the input gradient costs a forward again; weight gradients another forward's
    worth, but only for trained weights: all of them in full-parameter training, the
    adapters alone under LoRA. Attention's backward ≈ 2 forwards."""
    a = fp.args
    frozen = trained = 0.0
    for (place, _, expert, train), n in fp.buckets.items():
        if place == "embed":
            continue
        n = n * a.top_k / a.num_experts if expert else n
        if train:
            trained += n
        else:
            frozen += n
    keys = sum(mean_keys(seq_len, a.window(i)) for i in range(a.num_layers))  # per query, all layers
    attention = 2 * keys * a.num_heads * attention_width(a)
    forward = 2 * (frozen + trained) + attention
    return {"forward": forward, "backward": 2 * (frozen + trained) + 2 * trained + 2 * attention}


def mean_keys(seq_len: int, window: int) -> float:
    """Keys a query sees on average: T/2 under a causal mask; w - (w² - w)/(2T) under a window w < T."""
    if not window or window >= seq_len:
        return seq_len / 2
    return window - window * (window - 1) / (2 * seq_len)


def attention_width(args: ModelArgs) -> int:
    """D_qk + D_v of one head (MLA: the no-rope and rope parts of q·k, and v)."""
    if args.kv_lora_rank:
        return args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim
    return 2 * args.head_dim
