"""Parallel runs against the single-process run, on CPU with gloo in spawned processes.

Every rank also computes the single-process reference (the models are tiny), then runs the
same batch under a layout: the loss summed over data-parallel ranks and every LoRA gradient
(each rank's shard) must match the reference (rtol 1e-4), and so must the adapter after
three AdamW steps. Layouts: dp2, tp2, ep2, pp2 (every schedule), cp2 on 2 ranks; ep4, tp2×ep2,
dp2×ep2, dp2×tp2, pp2×tp2, pp2×ep2, cp2×tp2, cp2×ep2, pp2×cp2 on 4; pp2×dp2×tp2×ep2 and
pp2×cp2×tp2 on 8.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
from engine_helpers import free_port
from gloo_ranks import run_ranks
from hf_models import DEEPSEEK_V3, GLM4_MOE, GPT_OSS, QWEN3_MOE
from torch.distributed.tensor import Shard

from trillora import lora
from trillora.models import build_model, from_hf_config
from trillora.parallel import ParallelDims, ParallelError, build_meshes, parallelize
from trillora.parallel.data_parallel import expert_parameter_names
from trillora.policy.logprobs import token_logprobs

pytestmark = pytest.mark.slow  # spawned multi-rank layouts

# gpt-oss with a 4-token window, so the T = 10 rows (and cp's chunks) cross it
FAMILIES = {
    "qwen3_moe": QWEN3_MOE,
    "deepseek_v3": DEEPSEEK_V3,
    "glm4_moe": GLM4_MOE,
    "gpt_oss": dict(GPT_OSS, sliding_window=4),
}
TARGETS = ("attention", "mlp", "shared_experts", "experts", "router")
B, T = 8, 10


def reference(family: str):
    args = from_hf_config(FAMILIES[family], where=family)
    model = build_model(args, device="cpu")
    model.init_weights(std=0.08, generator=torch.Generator().manual_seed(0))
    lora.apply_lora(model, lora.LoraConfig(rank=4, targets=TARGETS))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in lora.lora_parameters(model):
            p.normal_(0, 0.05, generator=g)
    data = torch.Generator().manual_seed(2)
    ids = torch.randint(0, args.vocab_size, (B, T), generator=data)
    adv = torch.randn(B, generator=data)
    return model, ids, adv


def loss_fn(model, ids, adv, n_tokens: int):
    """A policy-gradient-shaped loss with an entropy bonus, normalised by the global token count
    (so it sums across data-parallel ranks); the trainer's logprob path (vocab-parallel aware)."""
    logp, entropy = token_logprobs(model, ids, 1.0, with_entropy=True)  # [b, T-1]
    return -(adv[:, None] * logp).sum() / n_tokens - 0.01 * entropy.sum() / n_tokens


def train_loss(model, par, ids, adv, n_tokens: int) -> torch.Tensor:
    """Forward and backward of `loss_fn` on this rank's rows, through the pipeline under pp (in
    two calls where the rows allow, as the trainer's minibatches do: gradients must accumulate)."""
    if par.pipeline is None:
        loss = loss_fn(model, ids, adv, n_tokens)
        loss.backward()
        return loss
    loss = 0
    for rows in torch.arange(ids.shape[0]).chunk(pipeline_calls(par, ids.shape[0])):
        a = adv[rows]
        loss = loss + par.pipeline.train_step(
            ids[rows],
            lambda logp, entropy, r, a=a: -(a[r, None] * logp).sum() / n_tokens - 0.01 * entropy.sum() / n_tokens,
        )
    return loss


def pipeline_calls(par, rows: int) -> int:
    microbatches = par.dims.pp_microbatches or par.dims.num_stages
    return 2 if rows % (2 * microbatches) == 0 else 1


def ep_view(ref: torch.Tensor, is_expert: bool, par, meshes) -> torch.Tensor:
    """This rank's experts of a full reference tensor (everything, for non-expert tensors)."""
    if is_expert and par.dims.ep > 1:
        local = ref.shape[0] // par.dims.ep
        ref = ref[meshes.rank("ep") * local : (meshes.rank("ep") + 1) * local]
    return ref


def full(t):
    """A DTensor (sharded over tp and/or by FSDP over dp) gathered; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def to_bf16_base(model) -> None:
    """The GPU setting: frozen base in bf16, adapters in fp32."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if not n.rpartition(".")[2].startswith("lora_"):
                p.data = p.data.to(torch.bfloat16)


def run_layout(family: str, dims: ParallelDims, base_dtype: str = "float32") -> None:
    ref, ids, adv = reference(family)
    tol = dict(rtol=1e-4, atol=1e-6)
    if base_dtype == "bfloat16":  # bf16 products round differently with a different batch split
        to_bf16_base(ref)
        tol = dict(rtol=3e-2, atol=1e-4)
    model = copy.deepcopy(ref)
    n_tokens = ids[:, 1:].numel()
    loss_ref = loss_fn(ref, ids, adv, n_tokens)
    loss_ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in lora.lora_parameters(ref)}

    experts = expert_parameter_names(model)
    meshes = build_meshes(dims, "cpu")
    par = parallelize(model, dims, meshes)
    dp_rank = meshes.rank("dp")
    rows = slice(dp_rank * B // dims.dp, (dp_rank + 1) * B // dims.dp)
    seen = []  # what the first norm receives: sequence shards under sp; twice when checkpointing recomputes
    first = model.model.layers[0] if par.pipeline is None or 0 in par.pipeline.stage_ids else None
    hook = (
        first.input_layernorm.register_forward_hook(
            lambda m, args, out: seen.append(getattr(args[0], "placements", None))
        )
        if first is not None
        else None
    )
    loss = train_loss(model, par, ids[rows], adv[rows], n_tokens)
    if dims.sp:
        assert seen[0] == (Shard(1),), seen
    if hook is not None:
        hook.remove()
        forwards = (dims.pp_microbatches or dims.num_stages) if par.pipeline else 1  # per call of the pipeline
        assert len(seen) == (2 if dims.activation_checkpoint_every else 1) * forwards * (
            pipeline_calls(par, B // dims.dp) if par.pipeline else 1
        ), seen  # static stage shapes: no extra forward
    sent = par.grad_sync()
    total = loss.detach().clone()
    dist.all_reduce(total, group=meshes.group("dp"))
    torch.testing.assert_close(total, loss_ref.detach(), **tol)
    params = dict(lora.lora_parameters(model))
    owned = [None] * dims.pp  # under pp each rank holds its stages' adapters; together, all of them
    dist.all_gather_object(owned, sorted(params), group=meshes.group("pp"))
    assert sorted(n for names in owned for n in names) == sorted(ref_grads)
    assert dims.pp == 1 or len(params) < len(ref_grads)
    for name, p in params.items():
        want = ep_view(ref_grads[name], name in experts, par, meshes)
        assert p.dtype == torch.float32  # adapters stay fp32 whatever the base
        torch.testing.assert_close(full(p.grad), want, **tol, msg=lambda m, n=name: f"{n}: {m}")
    # the clipping norm: every shard counted once (FSDP's strided shards of tp shards included)
    want_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()]))
    torch.testing.assert_close(par.grad_sync.norm(), want_norm, **tol)
    if par.pipeline is not None or par.context is not None:  # the no-grad logprob pass over the same layout
        with torch.no_grad():
            want, _ = token_logprobs(ref, ids, 1.0)
            got = par.pipeline.logprobs(ids[rows])[0] if par.pipeline else token_logprobs(model, ids[rows])[0]
        torch.testing.assert_close(got, want[rows], **tol)
    if base_dtype != "float32":
        return
    check_traffic(model, ref, params, par, sent, pipeline_calls(par, B // dims.dp) if par.pipeline else 1)

    # three optimiser steps on both sides give the same adapter
    # eps 1e-5 (not 1e-8): Adam divides by sqrt(v), so with a tiny eps a gradient that is ~0 turns
    # summation-order rounding (1e-7 relative) into a large part of a step; 1e-5 bounds that (with
    # 1e-6, one element of 256 moved 0.6% of a step apart on one machine's CPU, 0.4% on another's)
    opt_ref = torch.optim.AdamW([p for _, p in lora.lora_parameters(ref)], lr=1e-2, eps=1e-5)
    opt = torch.optim.AdamW(list(params.values()), lr=1e-2, eps=1e-5)
    for _ in range(3):
        opt_ref.step()
        opt_ref.zero_grad()
        loss_fn(ref, ids, adv, n_tokens).backward()
        opt.step()
        opt.zero_grad()
        train_loss(model, par, ids[rows], adv[rows], n_tokens)
        par.grad_sync()
    ref_params = dict(lora.lora_parameters(ref))
    for name, p in params.items():
        want = ep_view(ref_params[name].detach(), name in experts, par, meshes)
        torch.testing.assert_close(
            full(p.detach()),
            want,
            rtol=1e-4,
            atol=5e-5,  # 0.5% of one lr step
            msg=lambda m, n=name: f"{n} after 3 steps: {m}",
        )


def check_traffic(model, ref, params, par, sent: int, backwards: int) -> None:
    """Gradient traffic over data-parallel ranks is the adapter, never the base (once per backward:
    each pipeline call reduces the gradients it made)."""
    dims = par.dims
    adapter_full = sum(p.numel() * 4 for _, p in lora.lora_parameters(ref))
    base_full = sum(p.numel() * 4 for n, p in ref.named_parameters() if not n.rpartition(".")[2].startswith("lora_"))
    if par.fsdp is None:  # replicated: one all-reduce of the local adapter gradients
        adapter_local = sum(local(p).numel() * 4 for p in params.values())
        assert sent == par.grad_sync.bytes_per_step <= adapter_local
        if dims.dp > 1 and dims.edp > 1:
            assert sent == adapter_local
        if dims == ParallelDims(dp=2, fsdp=False):
            assert sent == adapter_full and sent < base_full / 4
        return
    assert sent == 0  # FSDP did the data-parallel reduction
    t = par.fsdp
    if dims == ParallelDims(dp=2):  # measured: reduce-scatters carry exactly the adapter's gradients,
        assert t.reduce_scatter_in == adapter_full  # all-gathers the model: every layer in forward and again in
        layers = 2 * (adapter_full + base_full - _root_once(ref))  # backward; the root (embeddings, head) 1-2 times
        assert layers + _root_once(ref) <= t.all_gather_out <= layers + 2 * _root_once(ref), (t.all_gather_out, t.calls)
    assert t.reduce_scatter_in <= backwards * adapter_full and adapter_full < base_full / 4


def _root_once(model) -> int:
    """Bytes of the root unit (embeddings, final norm, head), which FSDP may keep gathered for backward."""
    root = [model.model.embed_tokens, model.model.norm, model.lm_head]
    return sum(p.numel() * 4 for m in root for p in m.parameters())


def worker(rank: int, world: int, family: str, layouts: list[dict]) -> None:
    for layout in layouts:
        try:
            layout = dict(layout)
            base_dtype = layout.pop("base_dtype", "float32")
            run_layout(family, ParallelDims(**layout), base_dtype)
        except Exception as e:
            e.add_note(f"{family} {layout}")
            raise


def spawn(world: int, family: str, layouts: list[dict]) -> None:
    run_ranks(worker, world, family, layouts)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_rank_layouts_match_single_process(family):
    spawn(
        2,
        family,
        [
            dict(dp=2),
            dict(dp=2, fsdp=False),
            dict(tp=2),
            dict(tp=2, sp=True),
            dict(tp=2, vocab_parallel=True),
            dict(dp=2, ep=2, activation_checkpoint_every=1),
            dict(dp=2, base_dtype="bfloat16"),
        ],
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_pipeline_and_context_parallel_match_single_process(family):
    """pp2 under every schedule (interleaved and zero-bubble ones: 4 stages, the first of embeddings
    only), cp2 with and without FSDP over the context ranks; loss, gradients, logprob pass, 3 steps."""
    spawn(
        2,
        family,
        [dict(pp=2, pp_schedule=s) for s in ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv")]
        + [dict(cp=2), dict(cp=2, fsdp=False)],
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_four_rank_layouts_match_single_process(family):
    spawn(
        4,
        family,
        [
            dict(dp=4, ep=4),
            dict(dp=2, tp=2, ep=2),
            dict(dp=4, ep=2),
            dict(dp=2, tp=2),
            dict(dp=2, tp=2, fsdp=False),
            dict(dp=2, tp=2, ep=2, sp=True, vocab_parallel=True, activation_checkpoint_every=1),
        ],
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_four_rank_pipeline_and_context_layouts_match_single_process(family):
    """pp2×tp2, pp2×ep2 (over dp2, with and without FSDP), cp2×tp2 with sequence-parallel norms,
    cp2×ep2, and pp2×cp2: stages that see only their context rank's tokens."""
    spawn(
        4,
        family,
        [
            dict(pp=2, tp=2),
            dict(pp=2, tp=2, vocab_parallel=True, pp_schedule="zbv"),
            dict(pp=2, dp=2, ep=2),
            dict(pp=2, dp=2, ep=2, fsdp=False, pp_schedule="interleaved_1f1b"),
            dict(cp=2, tp=2, sp=True),
            dict(cp=2, dp=2, ep=2),
            dict(pp=2, cp=2, activation_checkpoint_every=1),
        ],
    )


@pytest.mark.parametrize(
    "family, layout",
    [
        ("deepseek_v3", dict(pp=2, dp=2, tp=2, ep=2, pp_schedule="interleaved_1f1b")),
        ("qwen3_moe", dict(pp=2, cp=2, tp=2, vocab_parallel=True)),
    ],
)
def test_eight_rank_3d_layouts_match_single_process(family, layout):
    """Three axes at once on 8 processes: pp2 × dp2 × tp2 with ep2 (expert shards over dp), and
    pp2 × cp2 × tp2 with the head split over the vocabulary; one family each (8 processes on two
    cores are the suite's dearest spawn; every 2- and 4-rank layout runs on both families)."""
    spawn(8, family, [layout])


def test_layout_errors_name_the_failing_product():
    with pytest.raises(ParallelError, match="ep=3 must divide parallel.dp=4"):
        ParallelDims(dp=4, ep=3)
    with pytest.raises(ParallelError, match="pp_schedule='2f2b'; allowed: gpipe, 1f1b, interleaved_1f1b"):
        ParallelDims(pp=2, pp_schedule="2f2b")
    with pytest.raises(ParallelError, match=r"pp_stage_layers=\[1, 2\]: need 4 counts"):
        ParallelDims(pp=2, pp_schedule="zbv", pp_stage_layers=(1, 2))
    with pytest.raises(ParallelError, match="sums to 2, but the model has 3 layers"):
        ParallelDims(pp=2, pp_stage_layers=(1, 1)).check_model(from_hf_config(QWEN3_MOE, where="q"))
    with pytest.raises(ParallelError, match="parallel.sp with parallel.pp > 1"):
        ParallelDims(pp=2, tp=2, sp=True)
    with pytest.raises(ParallelError, match=r"pp 1 × dp 2 × cp 1 × tp 2 = 4 ranks, but the job has 2"):
        ParallelDims(dp=2, tp=2).check_world(2)
    args = from_hf_config(QWEN3_MOE, where="q")
    with pytest.raises(ParallelError, match="num_experts=8 is not divisible by ep=3"):
        ParallelDims(dp=3, ep=3).check_model(args)
    with pytest.raises(ParallelError, match="num_attention_heads=4 is not divisible by tp=3"):
        ParallelDims(tp=3).check_model(args)


TRAIN_ARGS = [
    "steps=2",
    "eval_every=2",
    "rollout.prompts_per_step=8",
    "rollout.group_size=4",
    'rollout.precision="policy"',
    'lora.targets=["attention", "experts"]',
    "task.eval_problems=16",
    "task.eval_samples=1",
    'task.retention=""',
    "optim.lr=0.01",
    "optim.eps=1e-6",
    "algorithm.minibatches=2",
    "algorithm.kl_coef=0.01",
]


def run_train(out_dir, name: str, *overrides: str, ranks: int = 1):
    """`trillora train` for two steps (two minibatches, so old and reference logprob passes run too)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    args = ["-m", "trillora", "train", f"name={name}", f"out_dir={out_dir}", *TRAIN_ARGS, *overrides]
    if ranks > 1:
        torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
        cmd = [torchrun, "--nproc-per-node", str(ranks), "--master-port", str(free_port()), *args]
    else:
        cmd = [sys.executable, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out_dir / name


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    return run_train(tmp_path_factory.mktemp("single"), "one")


@pytest.mark.parametrize(
    "layout",
    [
        ("parallel.tp=2", "parallel.ep=2"),
        ("parallel.pp=2", "parallel.cp=2", 'parallel.pp_schedule="interleaved_1f1b"'),
        ("parallel.pp=2", "parallel.tp=2", "parallel.pp_microbatches=4"),
    ],
    ids=["dp2xtp2xep2", "pp2xcp2", "pp2xtp2"],
)
def test_torchrun_train_matches_single_process(tmp_path, single_run, layout):
    """`trillora train` on 4 ranks for two steps writes the same adapter as one process."""
    from safetensors.torch import load_file

    run = run_train(tmp_path, "par", *layout, ranks=4)
    summary = json.loads((run / "summary.json").read_text())
    expected = {k.split(".")[1]: json.loads(v) for k, v in (o.split("=") for o in layout)}
    assert {k: summary["parallel"][k] for k in expected} == expected
    # rank 0 exported from a skeleton (base on the meta device), not a copy of the model: the same counts
    assert summary["adapter"] == json.loads((single_run / "summary.json").read_text())["adapter"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    one = [json.loads(line) for line in (single_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["sync_bytes"] == 0 for r in rows[1:])  # no copy to sync
    for r, o in zip(
        rows[1:], one[1:], strict=True
    ):  # the loss's metrics reach rank 0 from the last stage, averaged alike
        for k in ("loss", "kl_ref", "entropy", "clip_frac", "grad_norm"):
            assert r[k] == pytest.approx(o[k], rel=1e-3, abs=1e-6), k
    if (
        "parallel.ep=2" in layout
    ):  # per-step traffic: FSDP gathers the base, reduce-scatters LoRA gradients; EP sends tokens
        for r in rows[1:]:
            assert r["comm_fsdp_all_gather_bytes"] > r["comm_fsdp_reduce_scatter_bytes"] > 0
            assert r["comm_ep_all_to_all_bytes"] > 0 and r["comm_dp_all_reduce_bytes"] == 0
    par = load_file(str(run / "adapter" / "fused" / "adapter_model.safetensors"))
    ref = load_file(str(single_run / "adapter" / "fused" / "adapter_model.safetensors"))
    assert par.keys() == ref.keys()
    for k in ref:  # the bound is 1% of one lr = 0.01 step: Adam turns summation-order rounding of ~0
        # gradients into visible steps (optim.eps=1e-6 damps it; 5.9e-5 was seen once); a real error is ~1e-2
        torch.testing.assert_close(par[k], ref[k], rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def test_parallel_config_derives_dp_and_needs_a_launch(tmp_path):
    from trillora.config import ConfigError, load_config
    from trillora.trainer import Trainer

    cfg = load_config(None, ["parallel.tp=2", "parallel.ep=2", f"out_dir={tmp_path}"])
    assert cfg.parallel.for_world(4) == ParallelDims(dp=2, tp=2, ep=2)
    with pytest.raises(ConfigError, match="parallel.tp=2 × pp=1 × cp=1 = 2 does not divide the 3 ranks"):
        cfg.parallel.for_world(3)
    deep = load_config(None, ["parallel.pp=2", "parallel.cp=2", "parallel.tp=2", f"out_dir={tmp_path}"])
    assert deep.parallel.for_world(16) == ParallelDims(dp=2, pp=2, cp=2, tp=2)
    with pytest.raises(ConfigError, match="ep=2 must divide parallel.dp=1"):
        cfg.parallel.for_world(2)
    with pytest.raises(ConfigError, match="needs a distributed launch: torchrun"):
        Trainer(cfg)
    with pytest.raises(ConfigError, match="pp=2 cp=1 needs a distributed launch"):
        Trainer(load_config(None, ["parallel.pp=2", f"out_dir={tmp_path}"]))


def test_in_process_vllm_is_refused_under_torchrun(tmp_path, monkeypatch):
    from trillora.config import ConfigError, load_config
    from trillora.trainer import Trainer

    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets; refused before any process group starts
    with pytest.raises(ConfigError, match="under torchrun serve vLLM and use rollout.engine='openai'"):
        Trainer(load_config(None, ['rollout.engine="vllm"', f"out_dir={tmp_path}"]))


def test_a_merged_engine_is_refused_under_torchrun_and_policy_samples_with_the_model(tmp_path, monkeypatch):
    """Under torchrun the local engine is the sharded policy itself (no whole copy on rank 0), so a
    merged precision is refused by name; in one process `policy` samples with the model itself."""
    from trillora.config import ConfigError, load_config
    from trillora.trainer import Trainer

    common = [f"out_dir={tmp_path}", "rollout.prompts_per_step=4", "rollout.group_size=2", "task.eval_problems=4"]
    trainer = Trainer(load_config(None, [*common, 'rollout.precision="policy"']))
    assert trainer.engine.model is trainer.model and trainer.full is trainer.model
    assert trainer.engine.sync(trainer.model)["sync_bytes"] == 0  # nothing to copy
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="rollout.precision='fp32' merges the adapter into a whole copy of the base"):
        Trainer(load_config(None, [*common, 'rollout.precision="fp32"']))


def test_micro_batches_accumulate_to_the_same_update(tmp_path):
    """parallel.micro_batch_rows splits each minibatch's forward + backward; the loss is normalised
    by the whole minibatch, so the accumulated gradient and the update are the same (to 0.3% of an
    lr step after 2 steps × 2 minibatches = 4 AdamW steps: Adam makes the summation order of ~0
    gradients visible; 0.13% was seen)."""
    from safetensors.torch import load_file

    a = run_train(tmp_path, "whole")
    b = run_train(tmp_path, "micro", "parallel.micro_batch_rows=3")
    ta = load_file(str(a / "adapter" / "fused" / "adapter_model.safetensors"))
    tb = load_file(str(b / "adapter" / "fused" / "adapter_model.safetensors"))
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], rtol=1e-5, atol=3e-5, msg=lambda m, k=k: f"{k}: {m}")
    ra = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()][1:]
    rb = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["loss"] for r in ra] == pytest.approx(
        [r["loss"] for r in rb], rel=1e-5, abs=1e-6
    )  # ~0: advantages sum to 0


def test_activation_checkpointing_in_one_process_changes_nothing_but_memory(tmp_path):
    from safetensors.torch import load_file

    from trillora.config import load_config
    from trillora.trainer import Trainer

    common = [
        f"out_dir={tmp_path}",
        "steps=1",
        "eval_every=1",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "task.eval_problems=8",
        "task.eval_samples=1",
        'task.retention=""',
        "optim.lr=0.01",
    ]
    Trainer(load_config(None, ["name=plain", *common])).run()
    trainer = Trainer(load_config(None, ["name=ac", "parallel.activation_checkpoint_every=1", *common]))
    calls = []
    trainer.model.model.layers[0].self_attn.register_forward_hook(lambda *a: calls.append(torch.is_grad_enabled()))
    trainer.run()
    assert calls.count(True) >= 2  # the training forward and its recompute in backward
    a = load_file(str(tmp_path / "plain" / "adapter" / "fused" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "ac" / "adapter" / "fused" / "adapter_model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-7)


ENV_ARGS = (
    'task.name="env"',
    'task.options={env = "trillora.envs.guessing:dataset", low = 1, high = 8}',
    "task.max_turns=3",
    "rollout.max_new_tokens=3",
    "task.eval_problems=4",
    "optim.eps=1e-3",
)
"""Every episode starts from the same observation, so the prompt's gradient contributions cancel to ~0
across groups; Adam's eps=1e-3 keeps their summation-order noise from turning into visible steps."""


@pytest.fixture(scope="module")
def single_env_run(tmp_path_factory):
    return run_train(tmp_path_factory.mktemp("env"), "one", *ENV_ARGS)


@pytest.mark.parametrize(
    "ranks, layout",
    [
        (2, ("parallel.ep=2",)),
        (2, ("parallel.tp=2",)),
        (4, ("parallel.tp=2",)),
    ],
    ids=["dp2xep2", "tp2", "dp2xtp2"],
)
def test_torchrun_multi_turn_env_matches_single_process(tmp_path, single_env_run, ranks, layout):
    """Masked multi-turn rows (the guessing game: observations mask 0 between actions, rows of
    different lengths) train to the same adapter under data, expert and tensor parallelism as in
    one process. (This found expert parallelism hanging when a rank's experts receive no rows, and
    the clipping norm missing the data-parallel part of FSDP's shards of tensor-parallel adapters:
    the guessing game's gradients are the first to exceed grad_clip in these runs.)"""
    from safetensors.torch import load_file

    one = single_env_run
    par = run_train(tmp_path, "par", *ENV_ARGS, *layout, ranks=ranks)
    rows = [json.loads(line) for line in (par / "metrics.jsonl").read_text().splitlines()]
    ref_rows = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines()]
    assert all(r["turns_mean"] > 1.0 for r in ref_rows[1:])
    for r, o in zip(rows[1:], ref_rows[1:], strict=True):
        assert r["turns_mean"] == o["turns_mean"]
        assert r["loss"] == pytest.approx(o["loss"], rel=1e-3, abs=1e-6)
        assert r["grad_norm"] == pytest.approx(o["grad_norm"], rel=1e-4)
    a = load_file(str(par / "adapter" / "fused" / "adapter_model.safetensors"))
    b = load_file(str(one / "adapter" / "fused" / "adapter_model.safetensors"))
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
