"""The memory layer on scripted trajectories: contexts worked out by hand, the budget never
exceeded, training samples split exactly where the memory rewrote the context, and a real engine
running long episodes through it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trillora.config import ConfigError, load_config
from trillora.context import Chunk, MemoryContext, Truncate, split_spans
from trillora.context.context import size
from trillora.envs.env import Env, StepResult, Trajectory, Transition
from trillora.envs.trajectory import merge_trajectory


def test_truncation_by_hand():
    m = MemoryContext(Truncate(), budget=12, reserve=2)  # the context may hold 10 tokens
    assert m.start([1, 2, 3]) == [1, 2, 3]
    # turn 1: action [4, 5], the env adds [6]: 6 tokens, fits
    assert m.step([4, 5], [1, 2, 3, 4, 5, 6], 1) == [1, 2, 3, 4, 5, 6]
    # turn 2: action [7, 8], the env adds [9]: 9 tokens, fits
    assert m.step([7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9], 2) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert m.rewrites == 0
    # turn 3: action [10], the env adds [11, 12]: 12 > 10, the oldest turn (4, 5, 6) goes; the task stays
    assert m.step([10], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 3) == [1, 2, 3, 7, 8, 9, 10, 11, 12]
    assert (m.rewrites, m.dropped) == (1, 3)
    # turn 4: the env's history goes on from ITS last observation; the policy's context from its own
    assert m.step([13], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], 4) == [1, 2, 3, 10, 11, 12, 13, 14]
    assert [c.turn for c in m.chunks] == [0, 3, 4] and (m.rewrites, m.dropped) == (2, 6)
    # an env that rewrites its own history starts the context over
    assert m.step([15], [1, 2, 99], 5) == [1, 2, 99] and [c.turn for c in m.chunks] == [0]


def test_spans_cut_turns_and_drop_finer():
    chunks = [Chunk([1, 2, 3], 0), Chunk([4, 5, 6, 7, 8], 1), Chunk([9, 10], 2)]
    assert split_spans(chunks, 2) == [
        Chunk([1, 2, 3], 0),
        Chunk([4, 5], 1),
        Chunk([6, 7], 1),
        Chunk([8], 1),
        Chunk([9, 10], 2),
    ]
    m = MemoryContext(Truncate(), budget=10, reserve=2, span_tokens=2)
    m.start([1, 2, 3])
    m.step([4, 5], [1, 2, 3, 4, 5, 6, 7, 8], 1)  # 8 tokens: fits
    # 10 > 8: the span [4, 5] goes (by whole turns, all of 4..8 would have gone)
    assert m.step([9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 2) == [1, 2, 3, 6, 7, 8, 9, 10]
    whole = MemoryContext(Truncate(), budget=10, reserve=2)
    whole.start([1, 2, 3])
    whole.step([4, 5], [1, 2, 3, 4, 5, 6, 7, 8], 1)
    assert whole.step([9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 2) == [1, 2, 3, 9, 10]


def test_spans_end_between_words():
    """With `word_cuts`, a span ends after the last space or newline that fits: "ok<eos>\nc=4 Q=7 X=2\n"
    in spans of 6 is "ok<eos>\n", "c=4 ", "Q=7 ", "X=2\n" (every 6 tokens, "c=4" would be cut after "c=")."""
    from trillora.checkpoint import load_tokenizer
    from trillora.context import word_cuts

    tok = load_tokenizer("tiny-moe")
    text = tok("ok", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    text += tok("\nc=4 Q=7 X=2\n", add_special_tokens=False)["input_ids"]
    spans = split_spans([Chunk([1], 0), Chunk(text, 1)], 6, word_cuts(tok))
    assert [tok.decode(c.tokens) for c in spans[1:]] == ["ok<eos>\n", "c=4 ", "Q=7 ", "X=2\n"]
    assert [tok.decode(c.tokens) for c in split_spans([Chunk(text, 1)], 6)] == ["ok<eos>\nc=", "4 Q=7 ", "X=2\n"]
    long = tok("abcdefgh ij klm", add_special_tokens=False)["input_ids"]  # a word longer than a span is cut
    assert [tok.decode(c.tokens) for c in split_spans([Chunk(long, 1)], 6, word_cuts(tok))] == [
        "abcdef",
        "gh ij ",
        "klm",
    ]


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 8),
    st.integers(0, 6),
    st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), max_size=20),
    st.integers(0, 4),
)
def test_the_budget_is_never_exceeded(task, reserve, turns, span):
    budget = task + reserve + 4
    m = MemoryContext(Truncate(), budget, reserve, span)
    env_history = list(range(task))
    context = m.start(env_history)
    for k, (action, added) in enumerate(turns, start=1):
        assert len(context) + reserve <= budget
        env_history = env_history + [100 + k] * action + [200 + k] * added
        context = m.step([100 + k] * action, env_history, k)
        assert context[:task] == list(range(task))  # the task is kept
    assert len(context) + reserve <= budget


def test_samples_split_where_the_memory_rewrote():
    """The policy's turns as training samples: one sequence until the rewrite, a new one after it."""
    m = MemoryContext(Truncate(), budget=12, reserve=2)
    history, transitions, context = [1, 2, 3], [], None
    context = m.start(history)
    for k, (action, added) in enumerate([([4, 5], [6]), ([7, 8], [9]), ([10], [11, 12]), ([13], [])], start=1):
        transitions.append(Transition(context, action, [-0.5] * len(action), 0.0, False))
        history = history + action + added
        context = m.step(action, history, k)
    first, second = merge_trajectory(Trajectory(transitions, context))
    assert first.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] and first.mask == [0, 0, 0, 1, 1, 0, 1, 1, 0, 1]
    assert second.tokens == [1, 2, 3, 7, 8, 9, 10, 11, 12, 13] and second.mask == [0] * 9 + [1]
    assert second.prompt_length == 9


class LongTalk(Env):
    """Many turns, each adding 5 tokens after the action: the whole history outgrows the budget."""

    def __init__(self, turns: int):
        self.history, self.left = [1, 7, 7, 7], turns

    def initial_observation(self):
        return list(self.history), []

    def step(self, action):
        self.left -= 1
        self.history += list(action) + [11, 12, 13, 14, 15]
        return StepResult(1.0, self.left == 0, list(self.history), [])


def test_long_episodes_through_a_real_engine_stay_within_the_budget():
    from trillora.checkpoint import load_model
    from trillora.envs.env import TrajectoryGroup
    from trillora.rollout import LocalEngine, SamplingParams
    from trillora.trainer.episodes import EpisodeLimits, episode_metrics, run_episodes

    engine = LocalEngine(load_model("tiny-moe"), precision="fp32")
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)
    limits = EpisodeLimits(max_turns=12, max_model_len=512, memory=lambda params, i: MemoryContext(Truncate(), 30, 4))
    trajectories = run_episodes(engine, [LongTalk(12), LongTalk(12)], params, limits)
    for t in trajectories:
        assert len(t.transitions) == 12 and t.stop_reason == "done"
        assert max(len(x.observation) for x in t.transitions) + 4 <= 30
        assert all(x.observation[:4] == [1, 7, 7, 7] for x in t.transitions)
        rewrites = sum(x.metrics.get("memory_rewrites", 0) for x in t.transitions)
        assert rewrites >= 3 and len(merge_trajectory(t)) == rewrites + 1
    metrics = episode_metrics([TrajectoryGroup(trajectories, [0.0, 0.0], [{}, {}])])
    assert metrics["env/memory_rewrites"] >= 3 and metrics["env/memory_dropped_tokens"] > 0


def test_config_names_what_is_wrong():
    with pytest.raises(ConfigError, match=r"memory.budget=4: it must be over rollout.max_new_tokens \(6\)"):
        load_config(None, ['task.name="env"', 'memory.policy="truncate"', "memory.budget=4"])
    with pytest.raises(ConfigError, match="memory.policy needs multi-turn episodes"):
        load_config(None, ['memory.policy="truncate"', "memory.budget=64"])


def test_the_ledger_asks_about_an_early_fact_that_truncation_loses():
    import random

    from trillora.checkpoint import load_tokenizer
    from trillora.envs.ledger import LedgerEnv, dataset, ledger

    tok = load_tokenizer("tiny-moe")
    lines, key, value = ledger(random.Random(0), facts=6, distractors=3, asked_from=2)
    assert len(lines) == 6 and f"{key}={value}" in " ".join(lines[:2])
    assert all(len(line.split()) == 4 for line in lines)  # the fact and three upper-case distractors
    ok = tok("ok", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def play(memory: MemoryContext | None, answer: str) -> tuple[float, str]:
        env = LedgerEnv(lines, key, value, tok)
        obs, _ = env.initial_observation()
        seen = memory.start(obs) if memory else obs
        for turn in range(1, 8):
            result = env.step(ok)
            seen = memory.step(ok, result.next_observation, turn) if memory else result.next_observation
        final = env.step(tok(answer, add_special_tokens=False)["input_ids"])
        return final.reward, tok.decode(seen)

    reward, full = play(None, str(value))
    assert reward == 1.0 and full.endswith(f"{key}?") and f"{key}={value}" in full
    assert full.startswith("<bos>remember:\nok<eos>\n" + lines[0])
    assert play(None, str((value + 1) % 10))[0] == 0.0
    whole = len(tok(full, add_special_tokens=False)["input_ids"])
    memory = MemoryContext(Truncate(), budget=whole // 2, reserve=4)
    _, kept = play(memory, str(value))
    assert kept.startswith("<bos>remember:\n") and kept.endswith(f"{key}?") and memory.rewrites > 0
    assert len(tok(kept, add_special_tokens=False)["input_ids"]) <= whole // 2 - 4
    assert f"{key}={value}" not in kept  # an early fact: truncation dropped it before the question
    ds = dataset(tok, batch_size=2, group_size=3, eval_size=4, seed=1)
    assert [g.key for g in ds.get_batch(5)] == [g.key for g in ds.get_batch(5)] and len(ds.eval_batch()) == 4
    with pytest.raises(ValueError, match="ledger needs 1 <= facts <= 26"):
        dataset(tok, 1, 1, 1, 0, facts=30)


@pytest.mark.slow
def test_train_runs_the_ledger_under_a_context_budget(tmp_path):
    """`trillora train` on the ledger with truncation: the run logs the memory's rewrites."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "trillora",
            "train",
            f"out_dir={tmp_path}",
            "name=ledger",
            "steps=1",
            "eval_every=1",
            'task.name="env"',
            'task.options={env = "trillora.envs.ledger:dataset"}',
            "task.max_turns=8",
            'task.retention=""',
            "task.eval_problems=2",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=4",
            'memory.policy="truncate"',
            "memory.budget=48",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads((tmp_path / "ledger" / "metrics.jsonl").read_text().splitlines()[1])
    assert row["env/memory_rewrites"] > 0 and row["turns_mean"] == 8


def test_allocation_rules_by_hand():
    from trillora.context.allocate import proportional, threshold, top_k

    # 12 tokens by importance 1:2:3 over chunks of 10 each: 2, 4, 6
    assert proportional([1, 2, 3], [10, 10, 10], 12) == [2, 4, 6]
    # the third chunk is only 3 long: it keeps 3, and the 9 left go 1:2 to the others -> 3, 6
    assert proportional([1, 2, 3], [10, 10, 3], 12) == [3, 6, 3]
    # 10 by 1:1:1 = 3.33 each: the spare token to the earliest largest remainder
    assert proportional([1, 1, 1], [9, 9, 9], 10) == [4, 3, 3]
    # more budget than tokens: everything verbatim; zero importance gets nothing
    assert proportional([1, 0, 5], [4, 6, 2], 50) == [4, 0, 2]
    assert top_k([0.2, 0.9, 0.5], [5, 5, 5], 11) == [0, 5, 5]
    assert top_k([0.5, 0.5, 0.1], [4, 4, 4], 5) == [0, 4, 0]  # ties: the later chunk first
    assert threshold([0.1, 0.6, 0.3], [10, 10, 10], 9, floor=0.25) == [0, 6, 3]
    with pytest.raises(ValueError, match="2 importances for 3 chunks"):
        proportional([1, 2], [1, 2, 3], 4)


def test_a_minimum_refill_drops_the_least_important_short_chunk_and_shares_again():
    from trillora.context.allocate import at_least, proportional

    share = lambda w: proportional(w, [6, 6, 6], 6)  # noqa: E731
    assert share([1, 2, 3]) == [1, 2, 3]
    # at least 2: the 1-token chunk goes, 6 is shared 2:3 -> 2.4 / 3.6 -> 2 / 4 (the spare to 0.6)
    assert at_least(share, [1, 2, 3], [6, 6, 6], 2) == [0, 2, 4]
    # at least 3: then the 2-token chunk goes too, and the last takes all 6
    assert at_least(share, [1, 2, 3], [6, 6, 6], 3) == [0, 0, 6]
    # a chunk shorter than the minimum may keep its whole length; 0 changes nothing
    assert at_least(lambda w: proportional(w, [2, 6], 8), [1, 1], [2, 6], 3) == [2, 6]
    assert at_least(share, [1, 2, 3], [6, 6, 6], 0) == [1, 2, 3]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.integers(0, 40)), min_size=1, max_size=8), st.integers(0, 120))
def test_allocations_stay_within_budget_and_lengths(chunks, budget):
    from trillora.context.allocate import proportional, top_k

    importance, lengths = [w for w, _ in chunks], [n for _, n in chunks]
    for rule in (proportional, top_k):
        out = rule(importance, lengths, budget)
        assert sum(out) <= budget and all(0 <= b <= n for b, n in zip(out, lengths, strict=True))
    out = proportional(importance, lengths, budget)
    useful = sum(n for w, n in zip(importance, lengths, strict=True) if w > 0)
    assert sum(out) == min(budget, useful)  # proportional spends all it can


@pytest.fixture(scope="module")
def tiny_engine():
    from trillora.checkpoint import load_model, load_tokenizer
    from trillora.rollout import LocalEngine

    return LocalEngine(load_model("tiny-moe"), precision="fp32"), load_tokenizer("tiny-moe")


def test_diffusion_masks_allocates_and_refills_by_hand(tiny_engine):
    from trillora.context import MemoryDiffusion, recency
    from trillora.rollout import SamplingParams

    engine, tok = tiny_engine
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=4, stop_token_ids=(tok.eos_token_id,))
    head, c1, c2, recent = Chunk([1, 14, 15, 16], 0), Chunk([20] * 6, 1), Chunk([21] * 6, 2), Chunk([22] * 4, 3)
    chunks = [head, c1, c2, recent]
    # room = 14 - 4 (task) - 4 (latest turn) = 6, shared 1:2 by recency: c1 refilled in 2, c2 in 4
    md = MemoryDiffusion(engine, tok, params, recency, "proportional")
    out = md.compress(chunks, 14)
    assert [c.turn for c in out] == [0, 1, 2, 3] and out[0] == head and out[-1] == recent
    assert len(out[1].tokens) <= 2 and len(out[2].tokens) <= 4 and size(out) <= 14
    first, second = md.refills
    marker = tok("\n[[", add_special_tokens=False)["input_ids"]
    assert first.prompt == head.tokens + marker + c1.tokens + tok("]] 2:\n", add_special_tokens=False)["input_ids"]
    assert (
        second.prompt[-len(tok("]] 4:\n", add_special_tokens=False)["input_ids"]) :]
        == tok("]] 4:\n", add_special_tokens=False)["input_ids"]
    )
    assert len(first.tokens) == len(first.logprobs) <= 2 and len(second.tokens) <= 4
    # top_k: c2 kept whole (the more recent), c1 dropped, nothing refilled
    md = MemoryDiffusion(engine, tok, params, recency, "top_k")
    assert md.compress(chunks, 14) == [head, c2, recent] and md.refills == []
    # the latest turn alone over the room (7 - 4 = 3 < 4): it is masked too; 3 tokens shared 1:2:3 by
    # recency are 0.5 / 1 / 1.5 -> 0 / 1 / 1, the spare token to the earlier of the tied remainders
    md = MemoryDiffusion(engine, tok, params, recency)
    out = md.compress(chunks, 7)
    assert [c.turn for c in out] == [0, 1, 2, 3] and all(len(c.tokens) <= 1 for c in out[1:])
    assert [r.prompt[-3:] for r in md.refills] == [tok("1:\n", add_special_tokens=False)["input_ids"]] * 3
    # the task alone over the limit: nothing to refill, the oldest go, as truncation does
    assert MemoryDiffusion(engine, tok, params, recency).compress(chunks, 3) == [head]
    # refill_context: each refill's prompt holds the chunks after its own, then the budget
    md = MemoryDiffusion(engine, tok, params, recency, "proportional", refill_context=True)
    md.compress(chunks, 14)
    first, second = md.refills

    def text(x: str) -> list[int]:
        return tok(x, add_special_tokens=False)["input_ids"]

    assert first.prompt == head.tokens + marker + c1.tokens + text("]]") + c2.tokens + recent.tokens + text("\n2:\n")
    assert second.prompt == head.tokens + marker + c2.tokens + text("]]") + recent.tokens + text("\n4:\n")


def test_policy_scores_equal_the_model_on_each_variant(tiny_engine):
    from trillora.context import policy_scores
    from trillora.policy.logprobs import next_token_logprobs

    engine, _ = tiny_engine
    chunks = [Chunk([1, 14, 15], 0), Chunk([20, 21, 22], 1), Chunk([30, 31], 2), Chunk([14, 84, 15, 98], 3)]

    def logp_of_latest(kept: list[Chunk]) -> float:
        ids = torch.tensor([[t for c in kept for t in c.tokens]])
        logp = torch.log_softmax(engine.model(ids).float(), -1)[0]
        start = ids.shape[1] - len(kept[-1].tokens)
        return float(logp[start - 1 : -1].gather(-1, ids[0, start:, None]).sum())

    with torch.no_grad():
        base = logp_of_latest(chunks)
        expected = [base - logp_of_latest([c for j, c in enumerate(chunks) if j != i]) for i in (1, 2)]
    assert policy_scores(next_token_logprobs(engine.model))(chunks, [1, 2]) == pytest.approx(expected, abs=1e-4)


def test_surprise_equals_transformers_loss_over_each_chunk():
    """A chunk's surprise is its tokens' mean NLL given all before it: transformers' loss with labels
    only on that chunk (-100 elsewhere) is the oracle."""
    import transformers

    from trillora.checkpoint import load_model, resolve_model_path
    from trillora.context import surprise
    from trillora.policy.logprobs import next_token_logprobs

    chunks = [Chunk([1, 31, 18], 0), Chunk([28, 24, 2, 99], 1), Chunk([16, 84, 8, 98], 2), Chunk([56, 84, 11], 3)]
    ids = torch.tensor([[t for c in chunks for t in c.tokens]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-moe"))
    expected = []
    for lo, hi in ((3, 7), (7, 11)):
        labels = torch.full_like(ids, -100)
        labels[0, lo:hi] = ids[0, lo:hi]
        with torch.no_grad():
            expected.append(float(hf(ids, labels=labels).loss))
    got = surprise(next_token_logprobs(load_model("tiny-moe")))(chunks, [1, 2])
    assert got == pytest.approx(expected, abs=1e-4)


def test_attention_mass_equals_transformers_attention_weights():
    """The attention each masked chunk gets from the latest turn, against the attention weights
    transformers returns for the same checkpoint (eager, fp32): mean over layers and heads, summed
    over the turn's queries and the chunk's keys."""
    import transformers

    from trillora.checkpoint import load_model, resolve_model_path
    from trillora.context import attention_mass

    chunks = [
        Chunk([1, 14, 15, 16], 0),
        Chunk([20, 21, 22, 23, 24], 1),
        Chunk([30, 31], 2),
        Chunk([40, 41, 42], 3),
        Chunk([14, 84, 15, 98], 4),
    ]
    ids = torch.tensor([[t for c in chunks for t in c.tokens]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-moe"), attn_implementation="eager")
    with torch.no_grad():
        weights = torch.stack(hf(ids, output_attentions=True).attentions)  # [layers, 1, H, S, S]
    per_key = weights[:, 0, :, -4:, :].mean(dim=1).sum(dim=1).mean(dim=0)  # [S]
    expected = [float(per_key[9:11].sum()), float(per_key[4:9].sum()), float(per_key[11:14].sum())]
    got = attention_mass(load_model("tiny-moe"))(chunks, [2, 1, 3])
    assert got == pytest.approx(expected, abs=1e-5)
    assert sum(got) < 4  # the turn's 4 queries spread one unit each, part of it on the task and on themselves


def test_attention_mass_with_sinks_and_windows_equals_transformers(tmp_path):
    """gpt-oss: the sinks take their share of every row and the sliding layers see 4 keys; transformers'
    eager attention weights (the sink column dropped) are the oracle."""
    from hf_models import GPT_OSS, hf_model, save_fused

    from trillora.checkpoint import load_model
    from trillora.context import attention_mass

    hf = hf_model(dict(GPT_OSS, sliding_window=4))
    chunks = [
        Chunk([1, 14, 15, 16], 0),
        Chunk([20, 21, 22, 23, 24], 1),
        Chunk([30, 31], 2),
        Chunk([40, 41, 42], 3),
        Chunk([14, 84, 15, 98], 4),
    ]
    ids = torch.tensor([[t for c in chunks for t in c.tokens]])
    with torch.no_grad():
        weights = torch.stack(hf(ids, output_attentions=True).attentions)  # [layers, 1, H, S, S]
    per_key = weights[:, 0, :, -4:, :].mean(dim=1).sum(dim=1).mean(dim=0)
    expected = [float(per_key[9:11].sum()), float(per_key[4:9].sum()), float(per_key[11:14].sum())]
    got = attention_mass(load_model(save_fused(hf, tmp_path / "gpt-oss")))(chunks, [2, 1, 3])
    assert got == pytest.approx(expected, abs=1e-5)
    assert got[1] > 0  # chunk 1 lies past the window of the sliding layers: only the full layers see it


def test_refills_are_trained_as_actions_of_the_episode(tiny_engine):
    from trillora.context import MemoryDiffusion, recency
    from trillora.rollout import SamplingParams
    from trillora.trainer.episodes import EpisodeLimits, run_episodes

    engine, tok = tiny_engine
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)

    def memory(call, i):
        return MemoryContext(MemoryDiffusion(engine, tok, call, recency), 30, call.max_new_tokens)

    (t,) = run_episodes(engine, [LongTalk(10)], params, EpisodeLimits(max_turns=10, max_model_len=512, memory=memory))
    refills = [x for x in t.transitions if "memory_refill_tokens" in x.metrics]
    turns = [x for x in t.transitions if "memory_refill_tokens" not in x.metrics]
    assert len(turns) == 10 and refills and all(x.reward == 0.0 for x in refills)
    assert max(len(x.observation) for x in turns) + 4 <= 30
    samples = merge_trajectory(t)
    refill_samples = [s for s in samples if s.tokens[: len(refills[0].observation)] == refills[0].observation]
    (s,) = refill_samples[:1]
    assert s.mask == [0] * len(refills[0].observation) + [1] * len(refills[0].action)  # the prompt is not trained


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["diffusion", "summary", "retrieval"])
def test_train_runs_the_policy_memories_on_the_ledger(tmp_path, policy):
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "trillora",
            "train",
            f"out_dir={tmp_path}",
            "name=md",
            "steps=1",
            "eval_every=1",
            'task.name="env"',
            'task.options={env = "trillora.envs.ledger:dataset"}',
            "task.max_turns=8",
            'task.retention=""',
            "task.eval_problems=2",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=4",
            f'memory.policy="{policy}"',
            "memory.budget=48",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads((tmp_path / "md" / "metrics.jsonl").read_text().splitlines()[1])
    assert row["env/memory_rewrites"] > 0 and row["turns_mean"] == 8
    assert (row.get("env/memory_refill_tokens", 0) > 0) == (policy != "retrieval")  # only policies that write


def test_summary_after_every_turn(tiny_engine):
    from trillora.context import Summarize
    from trillora.rollout import SamplingParams

    engine, tok = tiny_engine
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=2, stop_token_ids=(tok.eos_token_id,))
    policy = Summarize(engine, tok, params, max_tokens=5)
    m = MemoryContext(policy, budget=40, reserve=4)
    m.start([1, 14])
    m.step([20, 21], [1, 14, 20, 21, 30], 1)  # the task and one turn: nothing to summarise yet
    assert policy.refills == [] and m.rewrites == 0
    seen = m.step([22], [1, 14, 20, 21, 30, 22, 31, 32], 2)
    (refill,) = m.take_refills()
    marker = tok("\n[[summary]] 5:\n", add_special_tokens=False)["input_ids"]
    assert refill.prompt == [1, 14, 20, 21, 30] + marker and len(refill.tokens) <= 5
    summary = [t for t in refill.tokens if t != tok.eos_token_id]
    assert seen == [1, 14] + summary + [22, 31, 32] and m.rewrites == 1  # the task, the summary, the latest turn
    m.step([23], [1, 14, 20, 21, 30, 22, 31, 32, 23, 33], 3)
    (again,) = m.take_refills()
    assert again.prompt == [1, 14] + summary + [22, 31, 32] + marker  # the last summary and the turn since
    with pytest.raises(
        ConfigError, match="memory.policy='keep' is invalid; allowed: none, truncate, retrieval, summary, diffusion"
    ):
        load_config(None, ['memory.policy="keep"'])


def test_bm25_by_hand():
    from trillora.context import bm25

    # N = 2 docs, term 3 in one: idf = ln(1 + 1.5 / 1.5) = ln 2; doc [2, 3, 3]: tf 2, |d| 3, avg 2.5
    # 2 * 2.5 / (2 + 1.5 * (0.25 + 0.75 * 3 / 2.5)) = 5 / 3.725
    assert bm25([3], [[1, 2], [2, 3, 3]]) == pytest.approx([0.0, 0.6931472 * 5 / 3.725])
    assert bm25([9], [[1], [2]]) == [0.0, 0.0] and bm25([1], []) == []


def test_recall_answers_from_what_truncation_dropped(tiny_engine):
    from trillora.context import Recall

    _, tok = tiny_engine
    text = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    m = MemoryContext(Recall(tok), budget=50, reserve=4)
    task = text("remember:\n")
    history = task + []
    m.start(history)
    for turn, fact in enumerate(["c=4 Q=1", "d=7 R=2", "e=1 S=3", "f=2 T=5"], start=1):  # 11 tokens a turn
        history = history + text("ok") + text(f"\n{fact}\n")
        m.step(text("ok"), history, turn)
    assert m.rewrites > 0 and tok.decode(m.policy.store[0].tokens) == "ok\nc=4 Q=1\n"
    seen = m.intercept(text("recall:c="), (tok.eos_token_id,), 4)
    assert tok.decode(seen).endswith("recall:c=\n[recalled]\nok\nc=4 Q=1\n\n") and len(seen) + 4 <= 50
    assert m.intercept(text("ok"), (), 5) is None  # not a call: the env takes the turn
    assert m.full == history  # the env never saw the recall turn


def test_a_recall_turn_is_answered_by_the_memory_not_the_env(tiny_engine):
    """The real engine, with the policy's third turn replaced by a recall call (a policy that has
    learnt the tool): the runner routes it to the memory, trains it as a turn, and the env goes on
    as if it never happened."""
    import dataclasses

    from trillora.context import Recall
    from trillora.rollout import SamplingParams
    from trillora.trainer.episodes import EpisodeLimits, run_episodes

    engine, tok = tiny_engine
    call = tok("recall:", add_special_tokens=False)["input_ids"] + [11]

    class RecallsOnTurnThree:
        def __init__(self):
            self.calls = 0

        def generate(self, prompts, n, params):
            self.calls += 1
            out = engine.generate(prompts, n, params)
            if self.calls == 3:
                out = [
                    [dataclasses.replace(c, token_ids=call, logprobs=[-1.0] * len(call)) for c in row] for row in out
                ]
            return out

    env = LongTalk(6)
    limits = EpisodeLimits(max_turns=7, max_model_len=512, memory=lambda p, i: MemoryContext(Recall(tok), 30, 4))
    (t,) = run_episodes(RecallsOnTurnThree(), [env], SamplingParams(max_new_tokens=4, temperature=1.0, seed=3), limits)
    recalls = [k for k, x in enumerate(t.transitions) if "memory_recalls" in x.metrics]
    assert recalls == [2] and t.transitions[2].action == call and len(t.transitions) == 7
    assert env.left == 0 and t.stop_reason == "done"  # six env turns, plus the one the memory answered
    answer = tok("\n[recalled]\n", add_special_tokens=False)["input_ids"]
    after = t.transitions[3].observation
    assert any(after[k : k + len(call) + len(answer)] == call + answer for k in range(len(after)))  # the policy sees it


def test_a_refill_keeps_the_asked_fact_only_when_it_writes_it():
    from trillora.envs.ledger import refill_kept

    prompt = "remember:\n\n[[ok\nQ=7 c=4]] 3:\n"
    assert refill_kept(prompt, "c=4", "c", 4) is True
    assert refill_kept(prompt, "Q=7", "c", 4) is False
    assert refill_kept(prompt, "c=4", "c", 5) is None  # the chunk does not hold c=5
    assert refill_kept("remember:\n\n[[=4 R=2]] 2:\n", "=4", "c", 4) is None  # the span cut the fact
    # with the context after the chunk (memory.refill_context), a later "c=4" or "]]" is not the chunk
    after = "remember:\n\n[[ok\nQ=7 W=1]]ok\nc=4 ]] x\n3:\n"
    assert refill_kept(after, "c=4", "c", 4) is None
    assert refill_kept("remember:\n\n[[c=4]]ok\nd=1\n1:\n", "c=4", "c", 4) is True


def test_induction_rows_are_answered_only_by_a_lookup():
    """Each asked character is one of the distinct ones (never the last), its target is the one that
    followed it, and nothing else is trained; the characters are the tokenizer's digits and letters."""
    from trillora.checkpoint import load_tokenizer
    from trillora.tiny.memory import INDUCTION_CHARS, induction_rows

    ids, target = induction_rows(torch.Generator().manual_seed(3), batch=5, seen=6, asked=4)
    assert ids.shape == target.shape == (5, 6 + 8)
    for row, tgt in zip(ids.tolist(), target.tolist(), strict=True):
        first = row[:6]
        assert len(set(first)) == 6 and all(t in INDUCTION_CHARS for t in row)
        for i in range(4):
            query, successor = row[6 + 2 * i], row[7 + 2 * i]
            assert query in first[:-1] and successor == first[first.index(query) + 1]
            assert tgt[6 + 2 * i] == successor and tgt[7 + 2 * i] == -100
        assert tgt[:6] == [-100] * 6
    chars = load_tokenizer("tiny-moe").convert_ids_to_tokens(list(INDUCTION_CHARS))
    assert "".join(chars) == "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def test_refill_rows_keep_the_facts_that_fit_and_drop_the_distractors():
    """The warm-up's refill target: the span's lower-case facts in order, as many as fit the budget;
    every fact of the episode lies whole in one span (spans end between words)."""
    import random
    import re

    from trillora.checkpoint import load_tokenizer
    from trillora.tiny.memory_rows import kept_facts, refill_rows

    assert kept_facts("c=4 Q=7 d=5\n", 7) == "c=4 d=5"
    assert kept_facts("c=4 Q=7 d=5\n", 6) == "c=4" and kept_facts("Q=7 c=4", 2) == ""
    assert kept_facts("ok<eos>\nc=", 5) == ""  # half a fact is not a fact
    assert kept_facts("c=4 Q=7 d=5\n", 7, after="ok<eos>\nd=1 R=2") == "c=4"  # d is written again after it
    tok = load_tokenizer("tiny-moe")
    rows = refill_rows(tok, random.Random(5))
    facts = []
    for ids, mask in rows:
        prompt = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
        target = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
        head, span, budget = re.fullmatch(r"(.*)\n\[\[(.*)\]\] (\d+):\n", prompt, re.S).groups()
        assert head == "<bos>remember:\n" and 0 < int(budget) < len(span)
        assert target == kept_facts(span, int(budget)) + "<eos>"
        facts += re.findall(r"(?<![A-Za-z])[a-z]=\d", span)
    assert len(facts) >= 3 and len(set(facts)) == len(facts)  # seed 5: the ledger's facts, each once


def test_recall_rows_call_the_store_when_the_fact_has_left_the_context():
    """A recall row is what the real `Recall` memory shows: the question with the fact out of view,
    "recall:" + key, the store's reply holding the fact, then the value; with the fact in view, the value.
    (When the reply overflows the budget, the memory truncates again and the answer is a sample of its own.)"""
    import random

    from trillora.checkpoint import load_tokenizer
    from trillora.tiny.memory_rows import recall_rows

    tok = load_tokenizer("tiny-moe")
    called = direct = 0
    for seed in range(40):
        rows = recall_rows(tok, random.Random(seed))
        trained = [tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) for ids, mask in rows]
        text = tok.decode(rows[-1][0])
        value = trained[-1].removesuffix("<eos>")[-1]
        if "recall:" in "".join(trained):
            called += 1
            key = "".join(trained).split("recall:")[1][0]
            assert f"{key}={value}" in text.rsplit("recall:", 1)[-1]  # the store's reply (its turn cut to spans)
            assert f"{key}?" not in tok.decode(rows[0][0]).split("recall:")[0].rsplit("\n", 1)[0]
        else:
            direct += 1
            key = text.rsplit("\n", 1)[1][0]
            assert f"{key}={value}" in text and trained == [f"{value}<eos>"]
    assert called > 5 and direct > 5  # budgets 24-80 tokens: both happen


@pytest.mark.slow
def test_the_ledger_transcripts_are_the_env_and_build_memory_writes_a_checkpoint(tmp_path):
    """A supervised transcript is token for token what the env shows a policy that answers "ok" and
    then the value; `python -m trillora.tiny build-memory` writes a loadable checkpoint and its report."""
    import json
    import random
    import subprocess
    import sys

    from trillora.checkpoint import load_model, load_tokenizer
    from trillora.envs.ledger import LedgerEnv, ledger
    from trillora.tiny.memory import transcript

    tok = load_tokenizer("tiny-moe")
    ids, mask = transcript(tok, random.Random(7), more_questions=False)
    rng = random.Random(7)
    facts = rng.randint(1, 8)
    lines, key, value = ledger(rng, facts, rng.randint(0, 3), facts)
    env = LedgerEnv(lines, key, value, tok)
    seen, _ = env.initial_observation()
    ok = tok("ok", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    for _ in range(facts + 1):
        seen = env.step(ok).next_observation
    answer = tok(str(value), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids == seen + answer and env.step(answer).reward == 1.0
    assert [t for t, m in zip(ids, mask, strict=True) if m] == ok * (
        facts + 1
    ) + answer  # only the policy's tokens are trained
    more, more_mask = transcript(tok, random.Random(7))  # then every other fact is asked, answers trained
    assert more[: len(ids)] == ids and more_mask[: len(ids)] == mask
    asked = tok.decode(more[len(ids) :]).replace(tok.eos_token, "|")
    values = dict(p.split("=") for line in lines for p in line.split() if p.islower() or p[0].islower())
    pairs = [q.strip().split("?") for q in asked.split("|") if q.strip()]
    assert sorted(k for k, _ in pairs) == sorted(set(values) - {key}) and all(values[k] == v for k, v in pairs)
    assert sum(more_mask[len(ids) :]) == 2 * (len(values) - 1)  # a digit and the stop token per question

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "trillora.tiny",
            "build-memory",
            str(tmp_path / "m"),
            "--max-steps",
            "2",
            "--induction-steps",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "m" / "pretrain_report.json").read_text())
    assert (
        report["steps"] == 2
        and report["induction"]["steps"] == 2
        and 0.0 <= report["induction"]["accuracy"] <= 1
        and report["init_from"] == "tiny-moe"
        and 0.0 <= report["history"][-1]["ledger_success"] <= 1
    )
    held_out = report["history"][-1]  # the memory's actions taught beside the ledger, checked on held-out rows
    assert 0.0 <= held_out["refill_accuracy"] <= 1 and 0.0 <= held_out["recall_accuracy"] <= 1
    assert load_model(tmp_path / "m").args.vocab_size == 100


@pytest.mark.slow
def test_the_context_budget_benchmark_runs_every_policy(tmp_path):
    """`benchmarks/context_budget.py` at a small size: every policy at one budget, Memory Diffusion
    again after one RL step at that budget under two RL seeds (one row), the whole-context reference,
    tokens processed (the summary, rewriting every turn, reads the most), a plot."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "mb.json"
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "context_budget.py"
    run = subprocess.run(
        [
            sys.executable,
            str(bench),
            "--model",
            "tiny-moe",
            "--seeds",
            "0",
            "--episodes",
            "4",
            "--fractions",
            "0.5",
            "--rl-steps",
            "1",
            "--rl-seeds",
            "0",
            "1",
            "--out",
            str(out),
            "rollout.prompts_per_step=2",  # the RL runs small: one step of 2 groups of 4, 4 held-out episodes
            "rollout.group_size=4",
            "task.eval_problems=4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = {r["policy"]: r for r in report["rows"]}
    assert (
        set(rows) == {"truncate", "retrieval", "summary", "diffusion", "diffusion+rl"}
        and out.with_suffix(".png").exists()
    )
    rl = rows["diffusion+rl"]
    assert rl["rl_steps"] == 1 and rl["rl_flops"] > 0  # trained, then played
    assert rl["rl_seeds"] == [0, 1] and len(rl["success_per_rl_seed"]) == 2  # one row, each RL seed's success
    assert rl["success"] == pytest.approx(sum(rl["success_per_rl_seed"]) / 2)
    assert 0 <= rl["rl_training"]["groups_all_equal"] <= 1 and rl["rl_training"]["policy_tokens"] > 0
    assert rows["diffusion"]["refills"] > 0 and rows["truncate"]["refills"] == 0  # refill quality is counted
    assert rows["diffusion"]["refills_with_fact"] <= rows["diffusion"]["refills"]
    assert rows["diffusion"]["refills_with_room"] <= rows["diffusion"]["refills_with_fact"]  # budget could hold it
    assert all(r["budget"] == int(report["episode_tokens"] * 0.5) for r in rows.values())
    assert rows["summary"]["tokens_processed"] > rows["truncate"]["tokens_processed"]
