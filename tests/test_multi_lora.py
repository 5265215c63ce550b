"""Several adapters in one pass (`lora.multi`, `ResidentBase.use_many`) against the oracle of
one pass per adapter: logits, gradients and greedy samples equal, per adapter group and per
(expert, adapter) group in the MoE layers, with adapters of different ranks and roles."""

from __future__ import annotations

import itertools

import pytest
import torch
from hf_models import CONFIGS, hf_model, save_fused, tokens

import trillora
from trillora.lora.multi import RowAdapters
from trillora.policy.adapters import ResidentBase
from trillora.rollout.local import LocalEngine
from trillora.rollout.types import SamplingParams

TOL = 1e-5


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss"])
def resident(request, tmp_path_factory):
    hf = hf_model(CONFIGS[request.param])
    base = ResidentBase(trillora.load_model(save_fused(hf, tmp_path_factory.mktemp(request.param))))
    g = torch.Generator().manual_seed(3)
    adapters = [
        base.new_adapter(4, ("attention", "mlp", "shared_experts", "experts", "lm_head"), seed=1),
        base.new_adapter(2, ("mlp", "shared_experts", "experts"), seed=2),  # another rank, fewer roles
        base.new_adapter(8, ("attention",), seed=3),
    ]
    with torch.no_grad():
        for a in adapters:
            for p in a.params.values():
                p.normal_(0.0, 0.1, generator=g)  # B non-zero: every adapter really acts
    return base, adapters, hf.config.vocab_size


def alone(base, adapter, ids, weights):
    with base.use(adapter) as model:
        logits = model(ids)
    if adapter is None:
        return logits, {}
    (logits * weights).sum().backward()
    grads = {k: p.grad.clone() for k, p in adapter.params.items()}
    for p in adapter.params.values():
        p.grad = None
    return logits.detach(), grads


def test_rows_of_several_adapters_in_one_pass_equal_each_alone(resident):
    base, adapters, vocab = resident
    order = [adapters[0], None, adapters[1], adapters[2]]  # None: rows on the base alone
    rows = [2, 1, 1, 2]
    ids = tokens(vocab, batch=sum(rows), length=24, seed=5)
    weights = torch.randn(ids.shape[0], ids.shape[1], vocab, generator=torch.Generator().manual_seed(6))
    starts = [0, 2, 3, 4, 6]
    want = [alone(base, a, ids[s:e], weights[s:e]) for a, (s, e) in zip(order, itertools.pairwise(starts), strict=True)]
    with base.use_many(order, rows) as model:
        logits = model(ids)
        (logits * weights).sum().backward()
    for (ref_logits, ref_grads), a, (s, e) in zip(want, order, itertools.pairwise(starts), strict=True):
        assert (logits[s:e].detach() - ref_logits).abs().max() < TOL
        for k, g in ref_grads.items():
            assert (a.params[k].grad - g).abs().max() < TOL * max(1.0, float(g.abs().max())), k
    assert all(not m.lora_enabled and m.lora_multi is None for m in base.slots.values())  # slots cleared after
    for a in adapters:
        for p in a.params.values():
            p.grad = None


def test_expert_rows_are_grouped_per_expert_and_adapter():
    rows = RowAdapters([1, 2], [1.0, 0.5], torch.device("cpu"))
    rows.begin(torch.zeros(3, 2, dtype=torch.long))  # tokens 0-1 adapter 0, tokens 2-5 adapter 1
    indices_TK = torch.tensor([[1], [0], [1], [1], [0], [2]])
    order = torch.argsort(indices_TK.reshape(-1), stable=True)
    counts_E = torch.bincount(indices_TK.reshape(-1), minlength=3)
    groups, adapter_R, regroup = rows.expert_groups(counts_E, order)
    # expert 0: token 1 (adapter 0), token 4 (adapter 1); expert 1: tokens 0 | 2, 3; expert 2: token 5
    assert groups.tolist() == [1, 1, 1, 2, 0, 1]
    assert adapter_R.tolist() == [0, 1, 0, 1, 1, 1] and regroup is None  # one rank's rows: already grouped
    # rows expert parallelism brought from two ranks: within expert 0, adapters 1, 0, 1 (rank 0's rows, then rank 1's)
    groups, adapter_R, regroup = rows.expert_groups(torch.tensor([3, 1]), None, torch.tensor([1, 0, 1, 0]))
    assert groups.tolist() == [1, 2, 1, 0] and adapter_R.tolist() == [0, 1, 1, 0] and regroup.tolist() == [1, 0, 2, 3]
    with pytest.raises(ValueError, match="one row count >= 0 per adapter, some rows"):
        RowAdapters([0, 0], [1.0, 1.0], torch.device("cpu"))


def test_a_chunk_of_rows_keeps_each_rows_adapter():
    """A pipeline microbatch (`parallel.staged`) runs rows [lo, hi) of the batch: rows 0-1 adapter 0,
    row 2 adapter 1, rows 3-4 adapter 2, 2 tokens each (under cp: this rank's share, `tokens`)."""
    rows = RowAdapters([2, 1, 2], [1.0, 1.0, 1.0], torch.device("cpu"))
    rows.begin(torch.zeros(5, 8, dtype=torch.long), tokens=2)
    assert rows.counts.tolist() == [4, 2, 4]
    rows.select_rows(1, 4)  # rows 1, 2, 3
    assert rows.batch == 3 and rows.counts.tolist() == [2, 2, 2] and rows.token_adapter.tolist() == [0, 0, 1, 1, 2, 2]
    rows.select_rows(3, 5)
    assert rows.counts.tolist() == [0, 0, 4] and rows.token_adapter.tolist() == [2, 2, 2, 2]
    rows.select_rows(0, 5)
    assert rows.counts.tolist() == [4, 2, 4] and rows.batch == 5


def ep_worker(rank: int, world: int, folder: str) -> None:
    """Two expert-parallel ranks, each with its own rows of four adapters (one on no row here):
    logits, dense gradients summed over the ranks and each rank's expert slices equal to the one
    process running each adapter's rows of both ranks alone."""
    import torch.distributed as dist

    from trillora.parallel.expert_parallel import apply_expert_parallel
    from trillora.policy.shards import ExpertShard

    ref = ResidentBase(trillora.load_model(folder))
    g = torch.Generator().manual_seed(3)
    adapters = [
        ref.new_adapter(4, ("attention", "mlp", "shared_experts", "experts", "lm_head"), seed=1),
        ref.new_adapter(2, ("mlp", "shared_experts", "experts"), seed=2),
        ref.new_adapter(8, ("attention",), seed=3),
    ]
    with torch.no_grad():
        for a in adapters:
            for p in a.params.values():
                p.normal_(0.0, 0.1, generator=g)
    model = trillora.load_model(folder, experts=(rank, 2))
    base = ResidentBase(model)
    apply_expert_parallel(model, dist.group.WORLD, rank, 2)
    base.placement.experts = shard = ExpertShard(dist.group.WORLD, rank, 2, model.args.num_experts)
    mine = [base.adapter_from(a.config, a.tensors()) for a in adapters]
    order = [0, None, 1, 2]  # None: rows on the base alone
    rows = {0: [2, 1, 0, 1], 1: [0, 1, 2, 1]}  # adapter 1 has no row on rank 0, adapter 0 none on rank 1
    vocab = model.args.vocab_size
    ids = {r: tokens(vocab, batch=4, length=12, seed=10 + r) for r in rows}
    weights = {r: torch.randn(4, 12, vocab, generator=torch.Generator().manual_seed(20 + r)) for r in rows}
    starts = {r: [sum(rows[r][:k]) for k in range(5)] for r in rows}

    def part(r, k):  # the rows of rank r that adapter slot k runs
        return slice(starts[r][k], starts[r][k + 1])

    want_logits = {}
    for k, a in enumerate(order):  # the one-process oracle: each adapter on its rows of both ranks
        both = torch.cat([ids[r][part(r, k)] for r in rows])
        w = torch.cat([weights[r][part(r, k)] for r in rows])
        logits, grads = alone(ref, None if a is None else adapters[a], both, w)
        split = [len(range(4)[part(r, k)]) for r in rows]
        want_logits[k] = dict(zip(rows, logits.split(split), strict=True))
        if a is not None:
            for name, grad in grads.items():
                adapters[a].params[name].grad = grad
    with base.use_many([None if a is None else mine[a] for a in order], rows[rank]) as m:
        logits = m(ids[rank])
        (logits * weights[rank]).sum().backward()
    for k in range(4):
        if rows[rank][k]:
            assert (logits[part(rank, k)].detach() - want_logits[k][rank]).abs().max() < TOL, k
    for a, ours in zip(adapters, mine, strict=True):
        for name, p in ours.params.items():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if base.placement.is_expert(name):  # every rank's rows routed to these experts came here
                want = a.params[name].grad[shard.rows]
            else:  # this rank's rows only: the other rank's part is added
                dist.all_reduce(grad)
                want = a.params[name].grad
            assert (grad - want).abs().max() < TOL * max(1.0, float(want.abs().max())), name


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_rows_of_several_adapters_under_expert_parallelism_equal_each_alone(family, tmp_path):
    from gloo_ranks import run_ranks

    folder = save_fused(hf_model(CONFIGS[family]), tmp_path / family)
    run_ranks(ep_worker, 2, str(folder))


def test_one_generate_samples_several_revisions_as_each_alone(resident):
    base, adapters, vocab = resident
    engine = LocalEngine.sharing(base.model)
    revisions = [ResidentBase.revision(adapters[0]), None, ResidentBase.revision(adapters[1])]
    prompts = [[5, 9, 2, 7], [3, 3], [8, 1, 4]]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    want = []
    for r, p in zip(revisions, prompts, strict=True):
        with base.use(r):
            engine.forget()
            want.append(engine.generate([p], 2, params)[0])
    with base.use_many(revisions, [1, 1, 1]):
        engine.forget()
        got = engine.generate(prompts, 2, params)  # prefill [3, T], then decode [6, 1]
    for w, g in zip(want, got, strict=True):
        for a, b in zip(w, g, strict=True):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < TOL
    assert len({tuple(c[0].token_ids) for c in got}) > 1  # the revisions really differ
