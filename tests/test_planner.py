"""The planner's cost model: formulas on hand-computed cases, the seed's headline on paper, and
predictions against what the parallel engine measures on CPU/gloo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from gloo_ranks import run_ranks
from hf_models import DEEPSEEK_V3, QWEN3_MOE

from trillora.models import from_hf_config
from trillora.models.params import resolve_args
from trillora.parallel import ParallelDims
from trillora.plan.clusters import CLUSTERS
from trillora.plan.cost import Footprint, Training, Workload, activation_elements, estimate
from trillora.plan.planner import lora_vs_full, plan, rollout_layout, valid_layouts

TINY = Training(lora_rank=4, targets=("attention", "experts"), base_bytes=4)


def test_activation_elements_by_hand():
    """QWEN3_MOE test config: C 64, 4 heads × 16, 2 kv heads, 8 experts top-2 of 32, vocab 128, r 4.
    attention: norms 2·64+2 = 130, q/k norms (4+2)·17 = 102, flash q + out 2·64, k + v 2·32,
    lse 4 -> 428, LoRA input 64 + A·x 4·4 -> 508. MoE: probs 8, choices 6, gate/up/SiLU 3·2·32,
    weighted rows 2·64 -> 334, LoRA 2·2·64 + 3·2·32 + 3·2·4 -> 806. Dense MLP 3·96 = 288."""
    args = from_hf_config(QWEN3_MOE, where="q")
    got = activation_elements(args, TINY)
    assert got == {"attention": 508, "mlp": 288, "moe": 806, "head": 128}
    assert activation_elements(args, TINY, tp=2)["attention"] == 130 + (2 + 1) * 17 + 64 + 32 + 2 + 80


def test_traffic_and_bubble_formulas_by_hand():
    args = from_hf_config(QWEN3_MOE, where="q")
    fp = Footprint(args, TINY)
    work = Workload(seq_len=64, rollouts_per_step=8, micro_batch_rows=1)
    cpu = CLUSTERS["cpu"]
    e = estimate(fp, ParallelDims(dp=2, fsdp=False), work, cpu)
    assert e.comm == {"dp all-reduce": 2 * (1 / 2) * fp.trainable * 4}  # ring all-reduce of fp32 adapter gradients
    e = estimate(fp, ParallelDims(dp=2), work, cpu)  # FSDP: the adapter's gradients reduce-scattered once
    assert e.comm["fsdp reduce-scatter"] == fp.trainable * 4 / 2
    e = estimate(fp, ParallelDims(pp=2), work, cpu)  # 1F1B: (pp - 1) / microbatches; 8 rows of 1
    assert e.bubble == pytest.approx(1 / 8)
    # tp: two all-reduces per layer forward and two backward, ring factor 2(n-1)/n, 8 × 64 tokens of C 64 fp32
    e = estimate(fp, ParallelDims(tp=2), work, cpu)
    assert e.comm["tp"] == 2 * (1 / 2) * 3 * (8 * 64) * 64 * 4 * 2 * 2
    # parameters per rank: tp halves the split projections only; FSDP over dp halves everything
    full = fp.rank_numel(ParallelDims(), set(range(3)) | {"embed", "head"}, False)
    assert full == sum(n for (_, _, _, t), n in fp.buckets.items() if not t)
    assert fp.rank_numel(ParallelDims(dp=2), set(range(3)) | {"embed", "head"}, False) == full / 2


def test_training_flops_by_hand():
    """Attention: 2 · 3 layers · (T/2 = 5) · 4 heads · (16 + 16) = 3840 per token. Full-parameter
    backward is two forwards; LoRA's is one forward plus the adapters' weight gradients."""
    from trillora.plan.flops import training_flops

    args = from_hf_config(QWEN3_MOE, where="q")
    lora_fp, full_fp = Footprint(args, TINY), Footprint(args, Training(full=True))
    full, lo = training_flops(full_fp, 10), training_flops(lora_fp, 10)
    routed = sum(n for (place, _, expert, train), n in full_fp.buckets.items() if expert) * 2 / 8
    dense = sum(n for (place, _, expert, train), n in full_fp.buckets.items() if not expert and place != "embed")
    assert full["forward"] == 2 * (routed + dense) + 3840
    assert full["backward"] == 2 * full["forward"]
    adapters = sum(n * (2 / 8 if expert else 1) for (_, _, expert, train), n in lora_fp.buckets.items() if train)
    assert lo["forward"] == full["forward"] + 2 * adapters
    assert lo["backward"] == lo["forward"] + 2 * adapters + 3840


def test_valid_layouts_respect_the_engine_rules():
    args = resolve_args("qwen3-30b-a3b")
    work = Workload(seq_len=4096, rollouts_per_step=64)
    layouts = valid_layouts(args, 16, CLUSTERS["h100"], work)
    assert layouts and all(lay.world_size == 16 for lay in layouts)
    assert all(lay.tp <= 8 and args.num_heads % lay.tp == 0 and args.num_kv_heads % lay.tp == 0 for lay in layouts)
    assert all(lay.dp % lay.ep == 0 and args.num_experts % lay.ep == 0 for lay in layouts)
    assert {lay.cp for lay in layouts} <= {1, 2, 4, 8, 16}


@pytest.mark.slow
def test_kimi_k2_lora_fits_64_h800_and_full_parameter_needs_five_times_more():
    """The seed's headline on paper: Kimi K2, LoRA rank 128 on attention, dense MLP, shared and routed
    experts, GRPO with 512 rollouts of 16k tokens per step, fits 64 H800 (80 GiB, 10% kept free);
    full-parameter training needs at least 320 (fp32 gradients and AdamW on every weight), so
    LoRA needs 1/5 of the GPUs. At 32k tokens the best 64-GPU layout needs 72.7 of 72 usable GiB
    (the planner then asks for 96 GPUs, full-parameter 384)."""
    args = resolve_args("kimi-k2")
    training, work, h800 = Training(lora_rank=128), Workload(seq_len=16384, rollouts_per_step=512), CLUSTERS["h800"]
    p = plan(Footprint(args, training), 64, h800, work)
    assert p.fits and p.best[0].memory_total <= 72 * 2**30
    assert p.best[0].memory["base weights"] == pytest.approx(
        1.0264e12 * 2 / 64, rel=0.05
    )  # bf16 base over 64 (+ stage imbalance)
    assert lora_vs_full(args, training, h800, work) == {"lora_min_gpus": 64, "full_min_gpus": 320, "ratio": 64 / 320}
    r = rollout_layout(args, 64, h800, weight_bytes=1)  # fp8 weights: 958 GiB needs 4 nodes per replica
    assert (r.tp, r.pp, r.replicas) == (8, 4, 2)


@pytest.mark.slow
def test_plan_cli(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "trillora",
        "plan",
        "--model",
        "qwen3-30b-a3b",
        "--gpus",
        "8",
        "--gpu",
        "h100",
        "--seq-len",
        "8192",
        "--rollouts",
        "64",
        "--lora-rank",
        "32",
    ]
    out = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["fits"] and report["gpus"] == 8 and report["best"][0]["memory_total_gib"] < 80
    assert report["lora_vs_full"]["lora_min_gpus"] == 8 <= report["lora_vs_full"]["full_min_gpus"]  # one node at least
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert "chosen layout on 8 GPUs" in text.stdout and "memory per GPU" in text.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "trillora", "plan", "--model", "no-such-model"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "no-such-model" in bad.stderr
    # 97 ranks: a prime above the 48 layers, and 5 rows per step allow dp = 1 only
    odd = subprocess.run(
        [sys.executable, "-m", "trillora", "plan", "--model", "qwen3-30b-a3b", "--gpus", "97", "--rollouts", "5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert odd.returncode == 2 and "no layout of 97 ranks" in odd.stderr


# --- predictions against measurement (spawned gloo processes) ---------------------------------------

T, ROWS = 256, 4


def measure(family: str, dims) -> dict:
    """This rank's parameter bytes, measured activation peak, and counted collective bytes for
    one forward + backward of ROWS × T tokens (each data-parallel rank takes its share)."""
    from trillora import lora
    from trillora.models import build_model
    from trillora.parallel import build_meshes, parallelize
    from trillora.plan.memory_probe import MemoryProbe
    from trillora.policy.logprobs import token_logprobs

    args = from_hf_config({"qwen3_moe": QWEN3_MOE, "deepseek_v3": DEEPSEEK_V3}[family], where=family)
    model = build_model(args, device="cpu")
    model.init_weights(std=0.08, generator=torch.Generator().manual_seed(0))
    lora.apply_lora(model, lora.LoraConfig(rank=TINY.lora_rank, targets=TINY.targets))
    par = parallelize(model, dims, build_meshes(dims, "cpu"))
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    rows = ROWS // dims.dp
    ids = torch.randint(0, args.vocab_size, (rows, T), generator=torch.Generator().manual_seed(1))
    with MemoryProbe() as probe:
        probe.exclude(local)
        if par.pipeline is not None:
            par.pipeline.train_step(ids, lambda logp, entropy, r: -logp.sum() / (ROWS * T))
        else:
            (-token_logprobs(model, ids)[0].sum() / (ROWS * T)).backward()
    sent = par.grad_sync()
    return {
        "param_bytes": sum(p.numel() * p.element_size() for p in local),
        "peak": probe.report.peak_bytes,
        "reduce_scatter": par.fsdp.reduce_scatter_in if par.fsdp else 0,
        "all_reduce": sent,
        "all_gather": par.fsdp.all_gather_out if par.fsdp else 0,
    }


def worker(rank, world, family, layouts, results):
    from trillora.parallel import ParallelDims

    for layout in layouts:
        results.put((rank, json.dumps(layout), measure(family, ParallelDims(**layout))))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_predictions_match_measurement_on_two_ranks(family):
    """Per layout: parameter bytes per rank as predicted (to FSDP's padding), the bytes FSDP gathers
    and reduce-scatters and the bytes replicated data parallelism all-reduces as predicted, and
    the activation peak per rank within 25% of the measured one."""
    layouts = [dict(dp=2), dict(dp=2, fsdp=False), dict(tp=2), dict(cp=2, fsdp=False), dict(pp=2), dict(dp=2, ep=2)]
    results = mp.get_context("spawn").SimpleQueue()
    run_ranks(worker, 2, family, layouts, results)
    measured: dict[str, list[dict]] = {}
    while not results.empty():
        _, layout, m = results.get()
        measured.setdefault(layout, []).append(m)
    args = from_hf_config({"qwen3_moe": QWEN3_MOE, "deepseek_v3": DEEPSEEK_V3}[family], where=family)
    fp = Footprint(args, TINY)
    cpu = CLUSTERS["cpu"]
    for layout in layouts:
        got = measured[json.dumps(layout)]
        lay = ParallelDims(**layout)
        microbatch = ROWS // lay.dp // (2 if lay.pp > 1 else 1)
        e = estimate(fp, lay, Workload(seq_len=T, rollouts_per_step=ROWS, micro_batch_rows=microbatch), cpu)
        params = e.memory["base weights"] + e.memory["adapter + grads + optimizer"] / 16 * 4
        assert max(m["param_bytes"] for m in got) == pytest.approx(params, rel=0.02), layout
        activation = e.memory["activations"] + e.memory["transient"] + e.memory.get("fsdp gathered layers", 0)
        peak = max(m["peak"] for m in got)
        assert 0.75 <= activation / peak <= 1.25, (layout, activation, peak, e.memory)
        if "fsdp reduce-scatter" in e.comm:  # counted: the full buffers each rank reduce-scatters and gathers
            assert max(m["reduce_scatter"] for m in got) == pytest.approx(e.comm["fsdp reduce-scatter"] * 2, rel=0.02)
            assert max(m["all_gather"] for m in got) == pytest.approx(e.comm["fsdp all-gather"] * 2, rel=0.02)
        if "dp all-reduce" in e.comm:
            assert max(m["all_reduce"] for m in got) == e.comm["dp all-reduce"]


@pytest.mark.slow
def test_parallel_auto_picks_a_layout_the_trainer_runs(tmp_path):
    """`parallel = "auto"` under torchrun: the planner's layout for 2 ranks, recorded in the summary,
    and the run's adapter equals the single-process run's (as for any layout)."""
    from safetensors.torch import load_file
    from test_parallel import run_train

    from trillora.config import load_config

    assert load_config(None, ['parallel="auto"']).parallel.auto
    run = run_train(tmp_path, "auto", 'parallel="auto"', ranks=2)
    summary = json.loads((run / "summary.json").read_text())
    chosen = summary["parallel"]
    assert summary["parallel_auto"] and chosen["dp"] * chosen["tp"] * chosen["pp"] * chosen["cp"] == 2
    one = run_train(tmp_path, "one")
    a = load_file(str(run / "adapter" / "fused" / "adapter_model.safetensors"))
    b = load_file(str(one / "adapter" / "fused" / "adapter_model.safetensors"))
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"{chosen} {k}: {m}")


@pytest.mark.parametrize(
    "example,model,gpus,gpu",
    [
        ("kimi-k2-64xh800.toml", "kimi-k2", 64, "h800"),
        ("qwen3-30b-a3b-8gpu.toml", "qwen3-30b-a3b", 8, "h100"),
        ("gpt-oss-20b-python-tool.toml", "gpt-oss-20b", 8, "h100"),
    ],
)
def test_scale_examples_load_validate_and_fit(example, model, gpus, gpu):
    """The shipped scale configs: they load and validate, their layout suits the model and the
    world size, and the planner says that layout fits the GPUs' memory."""
    from trillora.config import load_config

    cfg = load_config(Path(__file__).parent.parent / "examples" / example)
    args = resolve_args(model)
    dims = cfg.parallel.for_world(gpus)
    dims.check_model(args)
    rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert rows // dims.dp // dims.pp_microbatches == 1  # the 1-row microbatches the plan assumes
    lora = cfg.lora
    training = Training(lora_rank=lora.rank, expert_rank=lora.rank_for_experts(args.top_k), targets=tuple(lora.targets))
    e = estimate(
        Footprint(args, training),
        dims,
        Workload(seq_len=cfg.rollout.max_model_len, rollouts_per_step=rows),
        CLUSTERS[gpu],
    )
    assert e.memory_total <= CLUSTERS[gpu].memory_gib * 2**30 * 0.9, {k: v / 2**30 for k, v in e.memory.items()}


def test_service_plan_counts_what_an_expert_parallel_service_holds():
    """`plan_service` on the shipped tiny MoE at ep=2: the base bytes and one client's adapter
    numel per rank are what rank 0 of a two-way expert-sharded service actually holds."""
    from trillora.checkpoint import load_model, resolve_model_path
    from trillora.models.moe import GroupedExperts
    from trillora.parallel.expert_parallel import shard_experts
    from trillora.plan.planner import REVISION_BYTES, plan_service
    from trillora.policy.adapters import ResidentBase, roles_of
    from trillora.policy.shards import ExpertShard

    model = load_model(resolve_model_path("tiny-moe-chat"))
    base = ResidentBase(model)
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            shard_experts(m, 0, 2)
    base.placement.experts = ExpertShard(None, 0, 2, model.args.num_experts)
    adapter = base.new_adapter(8, roles_of(True, True, True))
    held_base = sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n)
    held_client = sum(p.numel() for p in adapter.params.values())
    found = plan_service(model.args, 2, CLUSTERS["cpu"], clients=3, lora_rank=8, seq_len=64, rows=4, base_bytes=4)
    assert sorted(
        (
            x.layout.pp,
            x.layout.cp,
            x.layout.tp,
            x.layout.sp,
            x.layout.vocab_parallel,
            x.layout.ep,
            x.layout.fsdp,
            x.layout.activation_checkpoint_every,
        )
        for x in found
    ) == [
        (pp, cp, tp, sp, v, ep, f, ac)
        for pp, cp, tp, sp, v, ep, fsdp in [
            (1, 1, 1, False, False, 1, True),
            (1, 1, 1, False, False, 2, True),
            (1, 1, 2, False, False, 1, False),
            (1, 1, 2, False, True, 1, False),
            (1, 1, 2, True, False, 1, False),
            (1, 1, 2, True, True, 1, False),
            (1, 2, 1, False, False, 1, True),
            (2, 1, 1, False, False, 1, False),
        ]
        for f in sorted({False, fsdp})
        for ac in (0, 1)
    ]  # FSDP where there are dp × cp ranks to shard over
    layouts = {
        x.layout.ep: x
        for x in found
        if (x.layout.pp, x.layout.cp, x.layout.tp, x.layout.activation_checkpoint_every, x.layout.fsdp)
        == (1, 1, 1, 0, False)
    }
    sharded = next(
        x
        for x in found
        if x.layout.fsdp and x.layout.ep == 1 and not x.layout.activation_checkpoint_every and x.layout.cp == 1
    )
    assert sharded.estimate.memory["base weights"] == pytest.approx(layouts[1].estimate.memory["base weights"] / 2)
    assert sharded.per_client_bytes == layouts[1].per_client_bytes  # the clients' adapters stay whole
    two = layouts[2]
    assert two.estimate.memory["base weights"] == held_base * 4
    assert two.per_client_bytes == held_client * (16 + REVISION_BYTES)
    assert two.estimate.memory["clients: adapter + grads + AdamW + revision"] == 3 * two.per_client_bytes
    assert layouts[1].estimate.memory["base weights"] > two.estimate.memory["base weights"]  # the experts halved
    assert two.fits and two.max_clients >= 3


def test_service_plan_counts_a_vocabulary_parallel_head_and_context_parallel_rows():
    """tp=2 with the head split over the vocabulary holds half the head's weight and half of each
    client's lm_head B, and half the head's activations; sp keeps less (the norms' tokens split);
    cp=2 holds half of each row's activations, and the gathered K/V."""
    from trillora.checkpoint import load_model, resolve_model_path
    from trillora.plan.planner import REVISION_BYTES, plan_service

    model = load_model(resolve_model_path("tiny-moe-chat"))
    head, rank = model.lm_head.weight, 8
    found = plan_service(model.args, 2, CLUSTERS["cpu"], clients=3, lora_rank=rank, seq_len=64, rows=4, base_bytes=4)
    pick = {
        (x.layout.cp, x.layout.tp, x.layout.vocab_parallel): x
        for x in found
        if x.layout.pp == 1
        and x.layout.ep == 1
        and not x.layout.activation_checkpoint_every
        and not x.layout.sp
        and not x.layout.fsdp
    }
    sp = next(
        x for x in found if x.layout.sp and not x.layout.vocab_parallel and not x.layout.activation_checkpoint_every
    )
    assert (
        sp.estimate.memory["activations"] < pick[1, 2, False].estimate.memory["activations"]
    )  # norms on half the tokens
    whole, split = pick[1, 2, False], pick[1, 2, True]
    assert whole.estimate.memory["base weights"] - split.estimate.memory["base weights"] == head.numel() // 2 * 4
    assert whole.per_client_bytes - split.per_client_bytes == head.shape[0] // 2 * rank * (16 + REVISION_BYTES)
    assert split.estimate.memory["activations"] < whole.estimate.memory["activations"]
    one = next(
        x
        for x in plan_service(
            model.args, 1, CLUSTERS["cpu"], clients=3, lora_rank=rank, seq_len=64, rows=4, base_bytes=4
        )
        if not x.layout.activation_checkpoint_every
    )
    cp = pick[2, 1, False]  # the same 4 rows as one rank, half of each row's positions, and the gathered K/V
    assert (
        one.estimate.memory["activations"] / 2 < cp.estimate.memory["activations"] < one.estimate.memory["activations"]
    )
    assert cp.estimate.comm["cp K/V"] > 0 and cp.estimate.memory["base weights"] == one.estimate.memory["base weights"]


def test_service_plan_counts_what_a_pipeline_stage_holds():
    """`plan_service` at pp=2 counts the fullest stage: the base bytes and one client's adapter numel
    are what the last of two stages (`load_model(layers=...)`, as the service loads it) holds."""
    from trillora.checkpoint import load_model, resolve_model_path
    from trillora.plan.planner import REVISION_BYTES, plan_service
    from trillora.policy.adapters import ResidentBase, roles_of

    model = load_model(resolve_model_path("tiny-moe-chat"), layers=range(2, 4))  # norm and head beside two layers
    base = ResidentBase(model)
    adapter = base.new_adapter(8, roles_of(True, True, True))
    held_base = sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n)
    held_client = sum(p.numel() for p in adapter.params.values())
    found = plan_service(model.args, 2, CLUSTERS["cpu"], clients=3, lora_rank=8, seq_len=64, rows=4, base_bytes=4)
    staged = next(x for x in found if x.layout.pp == 2 and not x.layout.activation_checkpoint_every)
    whole = next(
        x
        for x in found
        if (x.layout.pp, x.layout.tp, x.layout.ep, x.layout.activation_checkpoint_every) == (1, 1, 1, 0)
    )
    assert staged.estimate.memory["base weights"] == held_base * 4
    assert staged.per_client_bytes == held_client * (16 + REVISION_BYTES)
    assert staged.estimate.memory["base weights"] < whole.estimate.memory["base weights"]
    assert staged.estimate.step_s > whole.estimate.step_s
    # a call's 4 rows in 4 chunks through the 2 stages: a bubble of 1/4 of a pass instead of the whole
    from dataclasses import replace

    from trillora.plan.planner import SERVICE_TARGETS, _service_layout

    assert staged.layout.pp_microbatches == 4
    fp = Footprint(model.args, Training(lora_rank=8, targets=SERVICE_TARGETS, base_bytes=4))
    in_turn = _service_layout(fp, replace(staged.layout, pp_microbatches=1), CLUSTERS["cpu"], 3, 64, 4, budget=1.0)
    assert staged.estimate.bubble == 0.25 and in_turn.estimate.bubble == 1.0
    assert staged.estimate.step_s / in_turn.estimate.step_s == pytest.approx(1.25 / 2)
    assert staged.estimate.memory["activations"] == in_turn.estimate.memory["activations"]  # GPipe holds every chunk


def readme_plan(command: str) -> tuple[dict, str]:
    """A `trillora plan` command the README shows: checked to be there, run (--json), and the README
    as one line of words to find the figures it quotes."""
    import contextlib
    import io

    from docs_pages import TEXT

    from trillora.cli import main

    readme = " ".join(TEXT.split())
    assert command in readme
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(command.split()[1:] + ["--json"]) == 0
    return json.loads(buf.getvalue()), readme


def test_readme_service_plan_command():
    """The README's `trillora plan --tinker` example and the figures it quotes."""
    out, readme = readme_plan(
        "trillora plan --model qwen3-30b-a3b --tinker --gpus 8 --gpu h100 --seq-len 4096 "
        "--rollouts 8 --lora-rank 8 --clients 8"
    )
    assert out["chosen"] == {
        "pp": 1,
        "tp": 1,
        "ep": 8,
        "cp": 1,
        "sp": False,
        "fsdp": False,
        "vocab_parallel": False,
        "activation_checkpoint_every": 0,
        "pp_microbatches": 1,
    }
    assert "--ep 8" in out["command"]
    assert "--no-fsdp" in out["command"]  # serve shards the base over dp by default; this layout keeps it whole
    assert "--tp" not in out["command"] and "--pp" not in out["command"] and "--activation" not in out["command"]
    assert [x["call_s"] for x in out["layouts"]] == sorted(x["call_s"] for x in out["layouts"])
    eight = next(x for x in out["layouts"] if (x["pp"], x["cp"], x["tp"], x["ep"], x["fsdp"]) == (1, 1, 1, 8, False))
    m = eight["memory_gib"]
    assert (
        round(m["base weights"], 1),
        round(m["activations"] + m["transient"], 1),
        round(eight["per_client_gib"], 1),
        eight["max_clients"],
    ) == (9.6, 45.9, 1.1, 14)
    assert [
        (x["ep"], x["activation_checkpoint_every"])
        for x in out["layouts"]
        if x["fits"] and x["tp"] == 1 and x["pp"] == 1 and x["cp"] == 1 and not x["fsdp"]
    ] == [(8, 0), (2, 1), (4, 1), (8, 1)]  # fastest first; without ac only ep=8 holds 8 clients
    one = next(x for x in out["layouts"] if (x["pp"], x["tp"], x["ep"]) == (1, 1, 1))
    assert one["memory_gib"]["base weights"] + one["memory_gib"]["activations"] > 72 and not one["fits"]
    assert (
        f"this gives ep={out['chosen']['ep']} ({eight['max_clients']} clients would fit). The base takes "
        f"{m['base weights']:.1f} GiB of each GPU and one pass of a 4096-token datum per GPU takes "
        f"{m['activations'] + m['transient']:.1f} GiB. Each client costs {eight['per_client_gib']:.1f} GiB"
    ) in readme


def test_readme_service_plan_for_kimi_k2():
    out, readme = readme_plan(
        "trillora plan --model kimi-k2 --tinker --gpus 64 --gpu h800 --seq-len 4096 "
        "--rollouts 64 --lora-rank 8 --clients 2"
    )
    assert out["chosen"] == {
        "pp": 8,
        "pp_microbatches": 8,
        "tp": 1,
        "ep": 8,
        "cp": 1,
        "sp": False,
        "fsdp": False,
        "vocab_parallel": False,
        "activation_checkpoint_every": 1,
    }
    sharded = next(x for x in out["layouts"] if x["fits"] and x["fsdp"] and (x["pp"], x["ep"]) == (1, 64))
    flat = next(x for x in out["layouts"] if x["fits"] and not x["fsdp"] and (x["pp"], x["ep"]) == (1, 64))
    assert sharded["per_client_gib"] == flat["per_client_gib"]
    assert (
        f"With `--fsdp` the dense layers are sharded too: ep=64 then keeps "
        f"{sharded['memory_gib']['base weights']:.1f} GiB of base per GPU and holds {sharded['max_clients']} clients, "
        f"at {sharded['call_s'] / flat['call_s']:.2f}× the time per call"
    ) in readme
    assert "--pp 8 --pp-microbatches 8 --ep 8 --activation-checkpoint-every 1" in out["command"]
    fit = [x for x in out["layouts"] if x["fits"]]
    fit = [x for x in fit if not x["fsdp"]]
    assert [
        (x["pp"], x["pp_microbatches"], x["cp"], x["tp"], x["ep"], x["activation_checkpoint_every"]) for x in fit
    ] == [(8, 8, 1, 1, 8, 1), (1, 1, 1, 1, 64, 1), (2, 2, 1, 1, 32, 1), (4, 4, 1, 1, 16, 1)]
    best, flat, two = fit[0], fit[1], fit[2]
    assert (
        f"Without pipeline stages only ep=64 with activation checkpointing fits: "
        f"{flat['memory_gib']['base weights']:.1f} GiB of base per GPU and {flat['per_client_gib']:.1f} GiB per "
        f"client (rank 8 on each of the 384 experts), so {flat['max_clients']} clients."
    ) in readme
    assert (
        f"{best['memory_gib']['base weights']:.1f} GiB of base per GPU leave room for {best['max_clients']} clients, "
        f"and a call takes {best['call_s']:.2f} s against ep=64's {flat['call_s']:.2f} s"
    ) in readme
    assert f"({best['comm_s']:.2f} s of traffic per call against {flat['comm_s']:.2f} s across 64 GPUs)" in readme
    assert (
        f"Two stages (`--pp 2 --pp-microbatches 2 --ep 32`) hold {two['memory_gib']['base weights']:.1f} GiB of base "
        f"per GPU and room for {two['max_clients']} clients, at {two['call_s'] / flat['call_s']:.1f}× ep=64's time "
        f"per call"
    ) in readme


def test_readme_service_plan_for_a_long_datum():
    out, readme = readme_plan(
        "trillora plan --model qwen3-30b-a3b --tinker --gpus 8 --gpu h100 --seq-len 32768 "
        "--rollouts 1 --lora-rank 8 --clients 8"
    )
    assert out["chosen"] == {
        "pp": 1,
        "tp": 1,
        "ep": 4,
        "cp": 2,
        "sp": False,
        "fsdp": False,
        "vocab_parallel": False,
        "activation_checkpoint_every": 1,
        "pp_microbatches": 1,
    }
    assert "--cp 2 --ep 4 --activation-checkpoint-every 1" in out["command"]

    def layout(pp, cp, tp, sp, vocab, ep):
        return next(
            x
            for x in out["layouts"]
            if (x["pp"], x["cp"], x["tp"], x["sp"], x["vocab_parallel"], x["ep"]) == (pp, cp, tp, sp, vocab, ep)
            and x["activation_checkpoint_every"]
            and not x["fsdp"]
        )

    def one_pass(x):
        return x["memory_gib"]["activations"] + x["memory_gib"]["transient"]

    best, whole, vocab = (
        layout(1, 2, 1, False, False, 4),
        layout(1, 1, 1, False, False, 4),
        layout(1, 1, 2, True, True, 4),
    )
    fit = [x for x in out["layouts"] if x["fits"] and not x["fsdp"]]
    assert fit[:2] == [best, vocab] and not whole["fits"] and whole["max_clients"] == 0
    assert one_pass(best) < one_pass(vocab) < one_pass(whole)
    assert (
        f"This picks `--cp 2 --ep 4 --activation-checkpoint-every 1` ({best['call_s']:.2f} s per call, "
        f"{best['max_clients']} clients fit): the datum's pass takes {one_pass(best):.1f} GiB of a GPU. Without cp one "
        f"rank runs the whole datum, and the same layout needs {one_pass(whole):.1f} GiB for it"
    ) in readme
    assert (
        f"`--tp 2 --sp --vocab-parallel --ep 4` ({vocab['call_s']:.2f} s per call, {vocab['max_clients']} clients), "
        f"needs "
        f"{one_pass(vocab):.1f} GiB"
    ) in readme


def test_readme_service_plan_with_divided_expert_rank(capsys):
    from trillora.cli import main

    out, readme = readme_plan(
        "trillora plan --model kimi-k2 --tinker --gpus 64 --gpu h800 --seq-len 4096 "
        "--rollouts 64 --lora-rank 8 --clients 2 --expert-rank 1"
    )
    fit = [x for x in out["layouts"] if x["fits"]]
    best, flat = fit[0], fit[1]
    assert (best["pp"], best["ep"], flat["pp"], flat["ep"]) == (8, 8, 1, 64)
    assert "--expert-rank-rule divide_by_top_k" in out["command"]
    assert (
        f"a client costs {flat['per_client_gib']:.2f} GiB at ep=64, which then holds {flat['max_clients']} clients; "
        f"`--pp 8 --ep 8` holds {best['max_clients']}."
    ) in readme
    capsys.readouterr()
    assert (
        main(["plan", "--model", "kimi-k2", "--tinker", "--lora-rank", "8", "--expert-rank", "3"]) != 0
    )  # no such service
    assert (
        "--expert-rank 3 with --tinker: a service's expert adapters take the client's rank (8) or rank // top_k (1"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(
            ["--model", "kimi-k2", "--gpus", "64", "--gpu", "h800", "--seq-len", "16384", "--rollouts", "512"],
            marks=pytest.mark.slow,  # a 64-GPU search: 18 s
        ),
        ["--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu", "h100"],
    ],
)
def test_plan_prints_a_launch_command_whose_overrides_give_the_chosen_layout(argv, capsys):
    import dataclasses
    import shlex

    from trillora.cli import main
    from trillora.cli.plan import render
    from trillora.config import load_config

    assert main(["plan", *argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    words = shlex.split(out["launch"])
    assert words[0] == "torchrun" and words[words.index("-m") + 1 : words.index("-m") + 4] == [
        "trillora",
        "train",
        "CONFIG.toml",
    ]
    nodes, per_node = int(words[words.index("--nnodes") + 1]), int(words[words.index("--nproc-per-node") + 1])
    assert nodes * per_node == out["gpus"]
    cfg = load_config(None, [w for w in words if "=" in w])
    chosen = ParallelDims(**out["best"][0]["layout"])
    assert {f.name: getattr(cfg.parallel, f.name) for f in dataclasses.fields(ParallelDims)} == dataclasses.asdict(
        chosen
    )
    render(out)
    assert f"launch (on every node): {out['launch']}" in capsys.readouterr().out
