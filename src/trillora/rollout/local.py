"""The built-in rollout engine: batched KV-cache sampling on its own copy of the weights.

The copy holds the base with the adapter merged, in the engine's own precision, so it
really differs from the trainer a little — the rollout/training mismatch the correction
exists for. On GPU it runs bf16. On CPU, where bf16 matrix products are ~150× slower than
fp32, it keeps the weights rounded to bf16 but computes in fp32: the same weight
numerics at fp32 speed. `sync()` refreshes only the tensors the adapters change.

Shape legend: B rows (prompts × n), T tokens, V vocabulary, L MoE layers, K top-k.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from ..lora.apply import lora_modules
from ..models import KVCache, build_model
from .routing import record_routing
from ..models.transformer import CausalLM
from .sampling import sample_next
from .types import Completion, PRECISIONS, SamplingParams



class LocalEngine:
    returns_routing = True

    def __init__(self, model: CausalLM, precision: str = "auto", device: str | torch.device | None = None, pad_id: int = 0):
        if precision not in PRECISIONS:
            raise ValueError(f"rollout precision {precision!r}; allowed: {', '.join(PRECISIONS)}")
        device = torch.device(device) if device is not None else next(model.parameters()).device
        if precision == "auto":
            precision = "bf16" if device.type == "cuda" else "bf16_weights"
        self.precision, self.device, self.pad_id = precision, device, pad_id
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.model = build_model(model.args, device=device, dtype=dtype)
        self.model.requires_grad_(False).eval()
        self.model.reset_buffers()
        self._copy_all(model)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(0)

    def pinned(self) -> None:
        return None  # a sync rewrites these weights in place

    # --- weights -------------------------------------------------------------------------
    def _store(self, dest: torch.Tensor, value: torch.Tensor) -> int:
        value = value.detach().to(self.device)
        if self.precision == "bf16_weights" and value.is_floating_point():
            value = value.to(torch.bfloat16)
        dest.copy_(value)  # rounds to bf16 (bf16_weights) or casts (bf16); fp32 copies exactly
        return value.numel() * value.element_size()

    @torch.no_grad()
    def _copy_all(self, model: nn.Module) -> None:
        own = self.model.state_dict()
        for name, t in model.state_dict().items():
            if name.rpartition(".")[2].startswith("lora_"):
                continue
            if name.endswith("e_score_correction_bias"):
                own[name].copy_(t)  # routing bias stays exact: it only steers the choice
            else:
                self._store(own[name], t)
        self.sync(model)

    @torch.no_grad()
    def sync(self, model: nn.Module) -> dict[str, float]:
        """Write base + scaling·B·A into every tensor an adapter touches (merged sync)."""
        start, sent = time.perf_counter(), 0
        for name, m in lora_modules(model):
            for tensor_name, delta in m.delta().items():
                base = getattr(m, tensor_name)
                merged = base if m.lora_merged else base + delta.to(base.dtype)
                sent += self._store(self.model.get_submodule(name).get_parameter(tensor_name), merged)
        return {"sync_bytes": float(sent), "sync_seconds": time.perf_counter() - start}

    def close(self) -> None:
        self.model = None

    # --- sampling ------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        rows = [p for p in prompts for _ in range(n)]
        b, width = len(rows), max(len(p) for p in rows)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):  # left padding: every row's last prompt token is at the end
            ids[i, width - len(p):] = torch.tensor(p, device=self.device)
            mask[i, width - len(p):] = 1
        stop = torch.tensor(params.stop_token_ids or [-1], device=self.device)
        cache = KVCache(len(self.model.model.layers), width + params.max_new_tokens)
        tokens, logprobs = [], []
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        lengths = torch.zeros(b, dtype=torch.long, device=self.device)
        recorder = record_routing(self.model) if params.return_routing else contextlib.nullcontext()
        with recorder as routes:
            # each prompt is prefilled once; its keys, values and last logits then serve its n samples
            logits = self.model(ids, attention_mask=mask, cache=cache)[:, -1].repeat_interleave(n, 0)  # [B, V]
            cache.expand(n)
            mask = mask.repeat_interleave(n, 0)
            for _ in range(params.max_new_tokens):
                tok, lp = sample_next(logits, params.temperature, params.top_k, params.top_p, self.generator)
                tok = tok.masked_fill(done, self.pad_id)
                tokens.append(tok)
                logprobs.append(lp)
                lengths += (~done).long()
                done = done | torch.isin(tok, stop)
                if bool(done.all()) or len(tokens) == params.max_new_tokens:
                    break
                mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype, device=self.device)], dim=1)
                logits = self.model(tok[:, None], attention_mask=mask, cache=cache)[:, -1]
        tok_BT = torch.stack(tokens, 1).tolist()
        lp_BT = torch.stack(logprobs, 1).float().tolist()
        routed = _stack_routes(routes, n) if params.return_routing else None  # [B, T_in, L, K]
        out: list[Completion] = []
        for i, p in enumerate(rows):
            k = int(lengths[i])
            stopped = k > 0 and tok_BT[i][k - 1] in params.stop_token_ids
            r = None
            if routed is not None:  # inputs were: left pads, prompt, completion[:-1]
                r = routed[i, width - len(p): width - len(p) + len(p) + k - 1].cpu()
            out.append(Completion(prompt_ids=list(p), token_ids=tok_BT[i][:k], logprobs=lp_BT[i][:k],
                                  finish_reason="stop" if stopped else "length", routed_experts=r))
        return [out[j * n:(j + 1) * n] for j in range(len(prompts))]


def _stack_routes(routes: dict[str, list[torch.Tensor]], n: int) -> torch.Tensor:
    """The first call of each layer is the prefill of the distinct prompts: repeated for their n rows."""
    per_layer = [torch.cat([calls[0].repeat_interleave(n, 0), *calls[1:]], dim=1) for calls in routes.values()]  # [B, T_in, K]
    return torch.stack(per_layer, dim=2)
