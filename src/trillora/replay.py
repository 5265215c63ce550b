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
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .models import compare_routing

MODES = ("off", "all", "old")


@dataclass
class RouterReplay:
    mode: str
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

    def metrics(self) -> dict[str, float]:
        if not self.tokens:
            return {}
        out = {f"routing_mismatch_l{i}": d / max(t, 1) for i, (d, t) in enumerate(zip(self.differ, self.tokens))}
        out["routing_mismatch"] = sum(self.differ) / max(sum(self.tokens), 1)
        return out
