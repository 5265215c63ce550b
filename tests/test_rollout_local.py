"""LocalEngine: KV-cache decoding against full recomputation, logprobs against the trainer,
bf16-rounded weights giving a real mismatch, stop tokens, seeds, routing, sync."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import build_batch
from hf_models import CONFIGS

from trillora import lora, rl
from trillora.models import build_model, from_hf_config
from trillora.policy.logprobs import token_logprobs
from trillora.rollout import LocalEngine, SamplingParams
from trillora.rollout.routing import record_routing

PROMPTS = [[5, 9, 3], [7, 1, 2, 8, 4, 6], [11]]


def tiny(name: str, seed: int = 0):
    config = dict(CONFIGS[name], sliding_window=4) if name == "gpt_oss" else CONFIGS[name]  # decoding crosses windows
    model = build_model(from_hf_config(config), device="cpu")
    model.init_weights(std=0.15, generator=torch.Generator().manual_seed(seed))
    return model.eval()


def greedy_by_recompute(model, prompt, steps):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_kv_cache_greedy_equals_full_recompute(name):
    model = tiny(name)
    engine = LocalEngine(model, precision="fp32")
    out = engine.generate(PROMPTS, 1, SamplingParams(max_new_tokens=12, temperature=0))
    for prompt, group in zip(PROMPTS, out, strict=True):
        assert group[0].token_ids == greedy_by_recompute(model, prompt, 12)
        assert group[0].finish_reason == "length"


def _trainer_logprobs(model, completions, temperature):
    flat = [c for g in completions for c in g]
    batch = build_batch([c.prompt_ids for c in flat], [c.token_ids for c in flat], [c.logprobs for c in flat])
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch.input_ids, temperature)
    return batch, logp


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_logprobs_match_trainer_and_bf16_weights_mismatch(name):
    model = tiny(name)
    params = SamplingParams(max_new_tokens=10, temperature=0.8, seed=3)
    exact = LocalEngine(model, precision="fp32").generate(PROMPTS, 4, params)
    batch, logp = _trainer_logprobs(model, exact, 0.8)
    m = batch.completion_mask.bool()
    assert (logp[m] - batch.rollout_logprobs[m]).abs().max() < 1e-4
    rounded = LocalEngine(model, precision="bf16_weights").generate(PROMPTS, 4, params)
    batch, logp = _trainer_logprobs(model, rounded, 0.8)
    _, metrics = rl.mismatch_weights(logp, batch.rollout_logprobs, batch.completion_mask, "none")
    assert metrics["mismatch_kl_k3"] > 0 and metrics["is_ratio_max"] != metrics["is_ratio_min"]
    weights, capped = rl.mismatch_weights(logp, batch.rollout_logprobs, batch.completion_mask, "token_tis", cap=1.001)
    assert weights.max() <= 1.001 and capped["is_limited_frac"] > 0  # TIS caps as configured


def test_stop_tokens_n_samples_and_seeds():
    model = tiny("qwen3_moe")
    engine = LocalEngine(model, precision="fp32")
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=7)
    a = engine.generate(PROMPTS, 3, params)
    b = engine.generate(PROMPTS, 3, params)
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    assert len(a) == 3 and all(len(g) == 3 for g in a)
    stop = a[0][0].token_ids[2]  # a token this seed is known to produce at step 3
    s = engine.generate(PROMPTS, 3, SamplingParams(max_new_tokens=20, temperature=1.0, seed=7, stop_token_ids=(stop,)))
    first = s[0][0]
    assert first.finish_reason == "stop" and first.token_ids[-1] == stop and len(first.token_ids) <= 3
    for c in (c for g in s for c in g):
        assert (c.finish_reason == "stop") == (stop in c.token_ids) and stop not in c.token_ids[:-1]
        assert len(c.logprobs) == len(c.token_ids)
    top1 = engine.generate(PROMPTS, 1, SamplingParams(max_new_tokens=8, temperature=1.0, top_k=1))
    greedy = engine.generate(PROMPTS, 1, SamplingParams(max_new_tokens=8, temperature=0))
    assert [g[0].token_ids for g in top1] == [g[0].token_ids for g in greedy]


def test_routing_is_returned_and_equals_trainer_routing():
    model = tiny("qwen3_moe")
    engine = LocalEngine(model, precision="fp32")
    out = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=6, temperature=1.0, seed=1, return_routing=True))
    args = model.args
    for c in (c for g in out for c in g):
        seq = c.prompt_ids + c.token_ids
        assert c.routed_experts.shape == (len(seq) - 1, len(args.moe_layers), args.top_k)
        with record_routing(model) as rec, torch.no_grad():
            model(torch.tensor([seq[:-1]]))
        trainer = torch.stack([calls[0][0] for calls in rec.values()], dim=1)  # [T, L, K]
        assert torch.equal(trainer.sort(-1).values, c.routed_experts.sort(-1).values)


def test_sync_reaches_the_engine():
    model = tiny("qwen3_moe")
    lora.apply_lora(model, lora.LoraConfig(rank=4))
    engine = LocalEngine(model, precision="fp32")
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=2)
    before = engine.generate(PROMPTS, 2, params)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in lora.lora_parameters(model):
            p.normal_(0, 0.2, generator=g)
    cost = engine.sync(model)
    assert cost["sync_bytes"] > 0
    after = engine.generate(PROMPTS, 2, params)
    batch, logp = _trainer_logprobs(model, after, 1.0)
    m = batch.completion_mask.bool()
    assert (logp[m] - batch.rollout_logprobs[m]).abs().max() < 1e-4  # engine == trainer with adapter
    assert [c.token_ids for g in before for c in g] != [c.token_ids for g in after for c in g]


def test_top_p_keeps_the_smallest_nucleus():
    from trillora.rollout import filter_logits

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = filter_logits(logits, top_k=0, top_p=0.7).isfinite()
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7, 0.5 + 0.3 crosses it
    assert filter_logits(logits, top_k=3, top_p=1.0).isfinite().tolist() == [[True, True, True, False]]


def test_sampling_follows_the_distribution():
    """Inverse-CDF sampling: frequencies match the softmax (chi-square-free check with a wide margin)."""
    from trillora.rollout import sample_next

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = torch.log(probs.clamp(min=1e-30)).expand(20000, 5)
    tok, lp = sample_next(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(0))
    freq = torch.bincount(tok, minlength=5).float() / tok.numel()
    assert (freq - probs).abs().max() < 0.015 and freq[4] == 0
    assert torch.allclose(lp, probs.log()[tok], atol=1e-5)
    tok_k, _ = sample_next(logits, 1.0, 2, 1.0, torch.Generator().manual_seed(1))
    assert set(tok_k.tolist()) == {0, 1}  # top-k = 2 keeps only the two most likely


def test_each_rows_own_filter_is_the_filter_of_that_row_alone():
    """Per-row top-k [B] and top-p [B] in one call: each row is what the one-setting filter gives it
    alone. Hand-checked row 1: softmax(2, 1, 0, -1) = (0.644, 0.237, 0.087, 0.032); top_p 0.7 keeps
    the first two (0.644 < 0.7, 0.644 + 0.237 crosses it)."""
    from trillora.rollout import filter_logits

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 3)
    top_k, top_p = torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.7, 1.0])
    kept = filter_logits(logits, top_k, top_p).isfinite().tolist()
    assert kept == [[True, True, False, False], [True, True, False, False], [True, True, True, True]]
    for row, (k, p) in enumerate(zip([2, 0, 0], [1.0, 0.7, 1.0], strict=True)):
        assert torch.equal(
            filter_logits(logits[row : row + 1], k, p), filter_logits(logits, top_k, top_p)[row : row + 1]
        )


def test_rows_with_their_own_settings_sample_as_they_would_alone():
    """`sample_rows`: one setting for every unseeded row draws exactly what `sample_next` draws; a
    greedy row is the argmax with temperature-1 logprobs; a seeded row draws from its own stream,
    whatever rows sit beside it."""
    from trillora.rollout.sampling import RowSettings, sample_next, sample_rows

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    same = RowSettings.of([SamplingParams(temperature=0.7, top_k=10, top_p=0.9)], 6, torch.device("cpu"))
    a = sample_rows(logits, same, torch.Generator().manual_seed(4))
    b = sample_next(logits, 0.7, 10, 0.9, torch.Generator().manual_seed(4))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    mixed = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=9), SamplingParams(temperature=0.5)]
    tok, lp = sample_rows(logits, RowSettings.of(mixed, 2, torch.device("cpu")), torch.Generator().manual_seed(1))
    assert tok[:2].tolist() == logits[:2].argmax(-1).tolist()
    assert torch.allclose(lp[:2], logits[:2].log_softmax(-1).gather(-1, tok[:2, None])[:, 0])
    alone, _ = sample_rows(logits[2:4], RowSettings.of(mixed[1:2], 2, torch.device("cpu")), torch.Generator())
    assert torch.equal(tok[2:4], alone)  # the seeded rows: their own streams (seed + row), not the shared one


def test_a_decode_of_several_requests_gives_each_what_it_gets_alone():
    """One `generate` over three prompts, each with its own settings (`each`): a greedy prompt of 3
    tokens, a seeded one of 8 stopping at a given id, an unseeded one of 5. The greedy and seeded
    rows are token for token what each gets alone, every row ends at its own length or stop."""
    engine = LocalEngine(tiny("qwen3_moe"), precision="fp32")
    engine.keep_kv = False
    greedy = SamplingParams(max_new_tokens=3, temperature=0)
    seeded = SamplingParams(max_new_tokens=8, temperature=1.0, seed=21)
    free = SamplingParams(max_new_tokens=5, temperature=1.0)
    alone = [engine.generate([p], 2, s, each=[s]) for p, s in zip(PROMPTS, (greedy, seeded, free), strict=True)]
    stop = alone[1][0][0].token_ids[3]  # a token the seeded row draws at its 4th step
    seeded_stop = SamplingParams(max_new_tokens=8, temperature=1.0, seed=21, stop_token_ids=(stop,))
    together = engine.generate(PROMPTS, 2, free, each=[greedy, seeded_stop, free])
    assert [c.token_ids for c in together[0]] == [c.token_ids for c in alone[0][0]]
    assert all(len(c.token_ids) == 3 and c.finish_reason == "length" for c in together[0])
    first = together[1][0]
    assert first.token_ids == alone[1][0][0].token_ids[: first.token_ids.index(stop) + 1]
    assert first.finish_reason == "stop" and len(first.token_ids) <= 4
    assert together[1][1].token_ids == alone[1][0][1].token_ids[: len(together[1][1].token_ids)]
    assert all(len(c.token_ids) == 5 for c in together[2])
    with pytest.raises(ValueError, match="2 settings for 3 prompts"):
        engine.generate(PROMPTS, 1, free, each=[free, free])


def test_a_prompt_sent_by_several_requests_is_prefilled_once():
    """A GRPO group sampled one call per sample (as tinker-cookbook's group rollouts do): 8 calls of
    the same prompt in one decode prefill it once (the tokens counted), and each seeded call gets
    what it gets alone; a distinct prompt beside them is prefilled on its own."""
    engine = LocalEngine(tiny("qwen3_moe"), precision="fp32")
    engine.keep_kv = False
    prompt, other = PROMPTS[1], PROMPTS[0]
    each = [SamplingParams(max_new_tokens=5, temperature=1.0, seed=s) for s in range(8)]
    alone = [engine.generate([prompt], 1, p, each=[p])[0][0].token_ids for p in each]
    before = engine.prefilled_tokens
    together = engine.generate([prompt] * 8 + [other], 1, each[0], each=[*each, each[0]])
    assert engine.prefilled_tokens - before == len(prompt) + len(other)  # not 8 × len(prompt)
    assert [g[0].token_ids for g in together[:8]] == alone
    assert len({tuple(t) for t in alone}) > 1  # eight different samples of the one prompt


def test_a_kept_row_is_continued_only_through_the_weights_it_ran_through():
    """`weights`: a served revision per prompt. The next turn through the same one prefills only its
    new tokens; through another (a different adapter), its whole prompt."""
    engine = LocalEngine(tiny("qwen3_moe"), precision="fp32")
    params = SamplingParams(max_new_tokens=4, temperature=0)
    a, b = object(), object()
    for through, fresh in ((a, False), (b, True)):
        first = engine.generate([PROMPTS[1]], 1, params, weights=[a])[0][0]
        following = PROMPTS[1] + first.token_ids + [3, 4]
        before = engine.prefilled_tokens
        engine.generate([following], 1, params, weights=[through])
        held = len(PROMPTS[1]) + len(first.token_ids) - 1  # the last sampled token was never fed
        assert engine.prefilled_tokens - before == (len(following) if fresh else len(following) - held)
    engine.max_kept_tokens = len(PROMPTS[1]) + 2  # under the decode's rows × length (6 + 3 fed): none kept
    first = engine.generate([PROMPTS[1]], 1, params, weights=[a])[0][0]
    before = engine.prefilled_tokens
    engine.generate([PROMPTS[1] + first.token_ids + [3]], 1, params, weights=[a])
    assert engine.prefilled_tokens - before == len(PROMPTS[1]) + len(first.token_ids) + 1
