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
from ..models.transformer import CausalLM
from .routing import record_routing
from .sampling import RowSettings, sample_next, sample_rows
from .types import PRECISIONS, Completion, SamplingParams


class LocalEngine:
    returns_routing = True

    def __init__(
        self, model: CausalLM, precision: str = "auto", device: str | torch.device | None = None, pad_id: int = 0
    ):
        """`precision="policy"`: sample with `model` itself, its own weights and precision, adapters
        applied unmerged as they are at each call. No copy of the base: what a resident base serving
        several adapters needs (it swaps the adapter in before `generate`), and a sharded policy
        under torchrun (every rank decodes its part, `policy.decoding`)."""
        if precision not in PRECISIONS:
            raise ValueError(f"rollout precision {precision!r}; allowed: {', '.join(PRECISIONS)}")
        device = torch.device(device) if device is not None else next(model.parameters()).device
        if precision == "auto":
            precision = "bf16" if device.type == "cuda" else "bf16_weights"
        self.precision, self.device, self.pad_id = precision, device, pad_id
        if precision == "policy":
            self.model = model
        else:
            self.model = build_model(
                model.args, device=device, dtype=torch.bfloat16 if precision == "bf16" else torch.float32
            )
            self.model.requires_grad_(False).eval()
            self.model.reset_buffers()
            with torch.no_grad():
                self._copy_base(model)
            self.sync(model)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(0)
        self._kept: _Kept | None = None
        """The last call's keys and values: a prompt that extends one of its rows (a multi-turn
        episode's next turn) prefills only its new tokens. Dropped when the weights change."""
        self.reused_tokens = 0  # prompt tokens not prefilled again thanks to `_kept`
        self.prefilled_tokens = 0  # prompt tokens run through the model (each distinct prompt once)
        self.keep_kv = True
        self.max_kept_tokens: int | None = None
        """Keep a decode's keys and values only when they hold at most this many tokens (rows × length)."""

    @classmethod
    def sharing(cls, model: CausalLM, pad_id: int = 0) -> LocalEngine:
        return cls(model, precision="policy", pad_id=pad_id)

    def pinned(self) -> None:
        return None  # a sync rewrites these weights in place

    # --- weights -------------------------------------------------------------------------
    def _store(self, dest: torch.Tensor, value: torch.Tensor) -> int:
        value = value.detach().to(self.device)
        if self.precision == "bf16_weights" and value.is_floating_point():
            value = value.to(torch.bfloat16)
        dest.copy_(value)  # rounds to bf16 (bf16_weights) or casts (bf16); fp32 copies exactly
        return value.numel() * value.element_size()

    def _copy_base(self, model: nn.Module) -> int:
        """Every weight but the adapters; the bytes written."""
        own, sent = self.model.state_dict(), 0
        for name, t in model.state_dict().items():
            if name.rpartition(".")[2].startswith("lora_"):
                continue
            if name.endswith("e_score_correction_bias"):
                own[name].copy_(t)  # routing bias stays exact: it only steers the choice
            else:
                sent += self._store(own[name], t)
        return sent

    @torch.no_grad()
    def sync(self, model: nn.Module) -> dict[str, float]:
        """Write base + scaling·B·A into every tensor an adapter touches (merged sync); every weight when
        the model has no adapters (full-parameter training)."""
        start, sent = time.perf_counter(), 0
        self._kept = None  # keys and values of the old weights
        if self.precision != "policy":  # "policy" samples with `model` itself
            adapted = list(lora_modules(model))
            if not adapted:  # full-parameter training: every weight moved
                sent = self._copy_base(model)
            for name, m in adapted:
                for tensor_name, delta in m.delta().items():
                    base = getattr(m, tensor_name)
                    merged = base if m.lora_merged else base + delta.to(base.dtype)
                    sent += self._store(self.model.get_submodule(name).get_parameter(tensor_name), merged)
        return {"sync_bytes": float(sent), "sync_seconds": time.perf_counter() - start}

    def forget(self) -> None:
        """Drop the kept keys and values (the episodes ended: their memory goes back)."""
        self._kept = None

    def close(self) -> None:
        self.model, self._kept = None, None

    # --- sampling ------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        each: list[SamplingParams] | None = None,
        weights: list | None = None,
    ) -> list[list[Completion]]:
        """n completions of each prompt. `each`: every prompt's own settings and seed (the requests
        that share this decode; `params` then only says whether to keep routing): a row ends at its
        own stop ids or `max_new_tokens`, and a seeded prompt's rows draw from their own streams.
        `weights`: what each prompt runs through (a served revision), when the rows of one decode
        differ: a prompt continues a kept row only if that row ran through the same."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if each is not None and len(each) != len(prompts):
            raise ValueError(f"{len(each)} settings for {len(prompts)} prompts")
        per_row = None if each is None else RowSettings.of(each, n, self.device)
        if per_row is None and params.seed is not None:
            self.generator.manual_seed(params.seed)
        rows = [p for p in prompts for _ in range(n)]
        b = len(rows)
        max_new = params.max_new_tokens if each is None else max(p.max_new_tokens for p in each)
        stop = torch.tensor(params.stop_token_ids or [-1], device=self.device) if per_row is None else per_row.stop
        tokens, logprobs = [], []
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        lengths = torch.zeros(b, dtype=torch.long, device=self.device)
        recorder = record_routing(self.model) if params.return_routing else contextlib.nullcontext()
        with recorder as routes:
            tags = [None] * len(prompts) if weights is None else [id(w) for w in weights]
            kept = self._continuing(prompts, tags) if self.keep_kv and not params.return_routing else None
            logits, cache, mask, width = (
                self._prefill(prompts, n, max_new, distinct=not params.return_routing and len(set(tags)) == 1)
                if kept is None
                else self._extend(rows, [r for r in kept for _ in range(n)], max_new)
            )
            first = mask.shape[1]  # the column of the first sampled token
            for _ in range(max_new):
                if per_row is None:
                    tok, lp = sample_next(logits, params.temperature, params.top_k, params.top_p, self.generator)
                else:
                    tok, lp = sample_rows(logits, per_row, self.generator)
                tok = tok.masked_fill(done, self.pad_id)
                tokens.append(tok)
                logprobs.append(lp)
                lengths += (~done).long()
                if per_row is None:
                    done = done | torch.isin(tok, stop)
                else:  # each row's own stop ids [B, S] and length
                    done = done | (tok[:, None] == stop).any(-1) | (lengths >= per_row.max_new_tokens)
                if bool(done.all()) or len(tokens) == max_new:
                    break
                mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype, device=self.device)], dim=1)
                logits = self.model(tok[:, None], attention_mask=mask, cache=cache, logits_to_keep=1)[:, -1]
        tok_BT = torch.stack(tokens, 1).tolist()
        lp_BT = torch.stack(logprobs, 1).float().tolist()
        routed = _stack_routes(routes, n) if params.return_routing else None  # [B, T_in, L, K]
        out: list[Completion] = []
        for i, p in enumerate(rows):
            k = int(lengths[i])
            stopped = k > 0 and tok_BT[i][k - 1] in (params if each is None else each[i // n]).stop_token_ids
            r = None
            if routed is not None:  # inputs were: left pads, prompt, completion[:-1]
                r = routed[i, width - len(p) : width - len(p) + len(p) + k - 1].cpu()
            out.append(
                Completion(
                    prompt_ids=list(p),
                    token_ids=tok_BT[i][:k],
                    logprobs=lp_BT[i][:k],
                    finish_reason="stop" if stopped else "length",
                    routed_experts=r,
                )
            )
        self._kept = None  # the last call's go, kept or not
        if not params.return_routing and (self.max_kept_tokens is None or mask.numel() <= self.max_kept_tokens):
            fed = torch.clamp(lengths, max=len(tokens) - 1)  # the last sampled token was never fed
            valid = mask.clone()
            valid[:, first:] = (torch.arange(mask.shape[1] - first, device=self.device)[None] < fed[:, None]).long()
            keys = {(tags[i // n], tuple(p + tok_BT[i][: int(fed[i])])): i for i, p in enumerate(rows)}
            self._kept = _Kept(cache, valid, keys, weights)
        return [out[j * n : (j + 1) * n] for j in range(len(prompts))]

    def _prefill(self, prompts: list[list[int]], n: int, max_new: int, distinct: bool = True):
        """Each prompt prefilled once; its keys, values and last logits then serve its n samples.
        `distinct`: a prompt that several requests sent (a GRPO group sampled one call per sample)
        is prefilled once for all of them (only where every row runs through the same weights: a
        pass of several adapters holds each one's rows where it put them)."""
        firsts: dict[tuple[int, ...], int] = {}
        of = [firsts.setdefault(tuple(p), len(firsts)) for p in prompts] if distinct else list(range(len(prompts)))
        run = [list(p) for p in firsts] if distinct else prompts
        ids, mask, width = self._left_padded(run)
        cache = KVCache(len(self.model.model.layers), width + max_new)
        logits = self.model(ids, attention_mask=mask, cache=cache, logits_to_keep=1)[:, -1]  # [len(run), V]
        self.prefilled_tokens += sum(len(p) for p in run)
        if len(run) < len(prompts):
            rows = torch.tensor(of, device=self.device)
            logits, mask = logits[rows], mask[rows]
            cache.select(rows)
        logits = logits.repeat_interleave(n, 0)  # [B, V]
        cache.expand(n)
        return logits, cache, mask.repeat_interleave(n, 0), width

    def _left_padded(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """ids and mask [B, W] with every row's last token at the end (W: the longest row)."""
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(seqs), width, dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            ids[i, width - len(s) :] = torch.tensor(s, device=self.device)
            mask[i, width - len(s) :] = 1
        return ids, mask, width

    def _continuing(self, prompts: list[list[int]], tags: list) -> list[int] | None:
        """For each prompt, the row of the last call whose tokens it extends (the next turn of the same
        episode) through the same weights (`tags`), or None when any prompt starts something new."""
        kept = self._kept
        if kept is None:
            return None
        sizes = sorted({len(k) for k in kept.key_of.values()}, reverse=True)
        found = []
        for p, tag in zip(prompts, tags, strict=True):
            row = next(
                (kept.rows[key] for size in sizes if size < len(p) and (key := (tag, tuple(p[:size]))) in kept.rows),
                None,
            )
            if row is None:
                return None
            found.append(row)
        return found

    def _extend(self, prompts: list[list[int]], rows: list[int], max_new: int):
        """Prefill only what each prompt adds to its kept row: the kept keys and values are gathered,
        the additions go in left-padded (pads masked out mid-sequence; positions count real tokens)."""
        kept, self._kept = self._kept, None
        old = kept.mask.shape[1]
        idx = torch.tensor(rows, device=self.device)
        added = [p[len(key) :] for p, key in zip(prompts, (kept.key_of[r] for r in rows), strict=True)]
        ids, new, width = self._left_padded(added)
        cache = KVCache(len(self.model.model.layers), old + width + max_new)
        for layer, (k, v) in enumerate(zip(kept.cache.k, kept.cache.v, strict=True)):
            if k is None:  # a layer this process does not run (another pipeline stage's)
                continue
            cache.k[layer] = k.new_empty(len(rows), k.shape[1], cache.max_len, k.shape[-1])
            cache.v[layer] = v.new_empty(len(rows), v.shape[1], cache.max_len, v.shape[-1])
            cache.k[layer][:, :, :old] = k[idx, :, :old]
            cache.v[layer][:, :, :old] = v[idx, :, :old]
        cache.length = old
        mask = torch.cat([kept.mask[idx], new], dim=1)
        self.reused_tokens += int(kept.mask[idx].sum())
        self.prefilled_tokens += sum(len(a) for a in added)
        logits = self.model(ids, attention_mask=mask, cache=cache, logits_to_keep=1)[:, -1]
        return logits, cache, mask, old + width


class _Kept:
    """The last call's keys and values, kept for the next turn of the same episodes."""

    def __init__(self, cache: KVCache, mask: torch.Tensor, rows: dict[tuple, int], weights: list | None):
        """`rows`: (weights' id, tokens) -> row; `weights` held, so that no id is reused while kept."""
        self.cache, self.mask, self.rows, self.weights = cache, mask, rows, weights  # mask [B, W]: real tokens
        self.key_of = {r: k for (_, k), r in rows.items()}


def _stack_routes(routes: dict[str, list[torch.Tensor]], n: int) -> torch.Tensor:
    """The first call of each layer is the prefill of the distinct prompts: repeated for their n rows."""
    per_layer = [
        torch.cat([calls[0].repeat_interleave(n, 0), *calls[1:]], dim=1) for calls in routes.values()
    ]  # [B, T_in, K]
    return torch.stack(per_layer, dim=2)
