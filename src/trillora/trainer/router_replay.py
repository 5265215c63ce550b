"""Router replay in the trainer's passes (`algorithm.router_replay`).

The rollout engine and the trainer can route a token to different experts (different numerics:
bf16 rollout weights, other kernels); importance sampling corrects the probabilities but not the
expert choice itself. With the routing recorded at rollout, a training pass can route each token to
the recorded experts, with gate weights from the trainer's own router scores over them:

- `all` (R3, arXiv:2510.11370): every training pass replays (old, reference and policy);
- `old`: only the old-logprob pass, so the proximal policy matches the sampler's routing;
- `off`: none.

Whatever the mode, the policy pass of the first epoch measures how many tokens the trainer's own
router sends elsewhere than the rollout did, per MoE layer (`routing_mismatch_l{i}`). Replay needs
the whole rows in one forward call, so passes it touches do not share prompts.

Applied from outside the model, like the parallel plans: a forward hook on each MoE block's
router compares its choice with the recorded one and, when replaying, returns the recorded
experts with the router's own weights over them (`Router.weights_for`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import RouterReplayMode
from ..rollout.routing import moe_blocks


class RoutingReference:
    """The experts another engine chose for each token of one forward call ([T, K], e.g. recorded at
    rollout), compared with a router's own choice and, when `replay`, used instead of it.

    Counts tokens (where `valid`) whose chosen set differs. The counts are taken on the first call
    only: activation checkpointing calls the layer again in backward."""

    def __init__(self, indices_TK: torch.Tensor, valid_T: torch.Tensor, replay: bool):
        self.indices, self.valid, self.replay = indices_TK, valid_T.bool(), replay
        self.differ, self.tokens, self.counted = 0, 0, False

    def __call__(self, router: nn.Module, args: tuple, output: tuple[torch.Tensor, torch.Tensor]):
        """Forward hook on a router: (weights [T, K], indices [T, K]) -> the same, or the replayed pair."""
        (x_TC,), (weights_TK, own_TK) = args, output
        ref = self.indices.to(own_TK.device, torch.long)
        if ref.shape != own_TK.shape:
            raise ValueError(f"recorded routing {tuple(ref.shape)} does not match this call's {tuple(own_TK.shape)}")
        if not self.counted:
            differ = (own_TK.sort(-1).values != ref.sort(-1).values).any(-1) & self.valid.to(own_TK.device)
            self.differ, self.tokens, self.counted = int(differ.sum()), int(self.valid.sum()), True
        if self.replay:
            return router.weights_for(x_TC, ref), ref
        return weights_TK, own_TK


@contextlib.contextmanager
def compare_routing(
    model: nn.Module, indices_BTLK: torch.Tensor, valid_BT: torch.Tensor, replay: bool
) -> Iterator[list[RoutingReference]]:
    """For one forward call over [B, T] tokens: each MoE layer l compares its routing with
    `indices_BTLK[:, :, l]` (and replays it when `replay`); yields the per-layer references."""
    blocks = [m for _, m in moe_blocks(model)]
    if indices_BTLK.shape[2] != len(blocks):
        raise ValueError(f"recorded routing covers {indices_BTLK.shape[2]} MoE layers; the model has {len(blocks)}")
    refs = [
        RoutingReference(indices_BTLK[:, :, i].reshape(-1, indices_BTLK.shape[-1]), valid_BT.reshape(-1), replay)
        for i in range(len(blocks))
    ]
    handles = [m.gate.register_forward_hook(r) for m, r in zip(blocks, refs, strict=True)]
    try:
        yield refs
    finally:
        for h in handles:
            h.remove()


@dataclass
class RouterReplay:
    """One batch's recorded routing and what the passes over it measured."""

    mode: RouterReplayMode
    routes: torch.Tensor  # [b, T, L, K] this rank's rows
    valid: torch.Tensor  # [b, T]
    differ: list[int] = field(default_factory=list)  # per MoE layer, tokens routed elsewhere (measured passes)
    tokens: list[int] = field(default_factory=list)

    def active(self, kind: str, measure: bool) -> bool:
        return self.replays(kind) or measure

    def replays(self, kind: str) -> bool:
        """`kind`: "old", "reference" or "policy"."""
        return self.mode == "all" or (self.mode == "old" and kind == "old")

    @contextlib.contextmanager
    def around(self, model, rows: torch.Tensor, kind: str, measure: bool):
        """One forward call over `rows`: replay and/or count, as the mode and `measure` say."""
        with compare_routing(model, self.routes[rows], self.valid[rows], self.replays(kind)) as refs:
            yield
        if measure:
            if not self.differ:
                self.differ, self.tokens = [0] * len(refs), [0] * len(refs)
            for i, r in enumerate(refs):
                self.differ[i] += r.differ
                self.tokens[i] += r.tokens

    @contextlib.contextmanager
    def pass_over(self, model, rows: torch.Tensor, kind: str, measure: bool = False) -> Iterator[bool]:
        """Around one training pass over `rows` (spanning its backward too, where checkpointed layers
        run again): yields whether the pass must run whole rows, the one forward call the recorded
        routing lines up with."""
        if not self.active(kind, measure):
            yield False
            return
        with self.around(model, rows, kind, measure):
            yield True

    def metrics(self) -> dict[str, float]:
        if not self.tokens:
            return {}
        out = {
            f"routing_mismatch_l{i}": d / max(t, 1)
            for i, (d, t) in enumerate(zip(self.differ, self.tokens, strict=True))
        }
        out["routing_mismatch"] = sum(self.differ) / max(sum(self.tokens), 1)
        return out
