"""Several adapters in one pass (`lora.multi`, `ResidentBase.use_many`) against the oracle of
one pass per adapter: logits, gradients and greedy samples equal, per adapter group and per
(expert, adapter) group in the MoE layers, with adapters of different ranks and roles."""

from __future__ import annotations

import pytest
import torch

import trillora
from hf_models import CONFIGS, hf_model, save_fused, tokens
from trillora.lora.multi import RowAdapters
from trillora.rollout.local import LocalEngine
from trillora.rollout.types import SamplingParams
from trillora.serve.adapters import ResidentBase

TOL = 1e-5


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss"])
def resident(request, tmp_path_factory):
    hf = hf_model(CONFIGS[request.param])
    base = ResidentBase(trillora.load_model(save_fused(hf, tmp_path_factory.mktemp(request.param))))
    g = torch.Generator().manual_seed(3)
    adapters = [base.new_adapter(4, ("attention", "mlp", "shared_experts", "experts", "lm_head"), seed=1),
                base.new_adapter(2, ("mlp", "shared_experts", "experts"), seed=2),  # another rank, fewer roles
                base.new_adapter(8, ("attention",), seed=3)]
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
    want = [alone(base, a, ids[s:e], weights[s:e]) for a, s, e in zip(order, starts, starts[1:])]
    with base.use_many(order, rows) as model:
        logits = model(ids)
        (logits * weights).sum().backward()
    for (ref_logits, ref_grads), a, s, e in zip(want, order, starts, starts[1:]):
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
    groups, adapter_R = rows.expert_groups(counts_E, order)
    # expert 0: token 1 (adapter 0), token 4 (adapter 1); expert 1: tokens 0 | 2, 3; expert 2: token 5
    assert groups.tolist() == [1, 1, 1, 2, 0, 1]
    assert adapter_R.tolist() == [0, 1, 0, 1, 1, 1]


def test_one_generate_samples_several_revisions_as_each_alone(resident):
    base, adapters, vocab = resident
    engine = LocalEngine.sharing(base.model)
    revisions = [ResidentBase.revision(adapters[0]), None, ResidentBase.revision(adapters[1])]
    prompts = [[5, 9, 2, 7], [3, 3], [8, 1, 4]]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    want = []
    for r, p in zip(revisions, prompts):
        with base.use(r):
            engine.forget()
            want.append(engine.generate([p], 2, params)[0])
    with base.use_many(revisions, [1, 1, 1]):
        engine.forget()
        got = engine.generate(prompts, 2, params)  # prefill [3, T], then decode [6, 1]
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < TOL
    assert len({tuple(c[0].token_ids) for c in got}) > 1  # the revisions really differ
