"""LoRA on dense and expert layers against oracles: PEFT on the transformers model, transformers
running a merged per-expert checkpoint, and straightforward per-expert loops."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers
from hf_models import CONFIGS, hf_model, save_fused, tokens
from safetensors.torch import load_file, save_file

import trillora
from trillora import lora
from trillora.lora.layers import LoraGroupedExperts
from trillora.models import set_grouped_gemm
from trillora.models.moe import dispatch_combine

TOL = 1e-4

CASES = {
    "qwen3_moe": dict(rank=4, alpha=8.0),
    "deepseek_v3": dict(rank=4, alpha=8.0, expert_rank=8, rslora=True),
    "kimi_k2_shaped": dict(rank=8, alpha=16.0, expert_rank_rule="divide_by_top_k"),  # experts get 8 // 4 = 2
    "qwen3_moe_router_head": dict(rank=4, alpha=4.0, targets=lora.ROLES),
    "glm4_moe": dict(rank=4, alpha=8.0, expert_rank=1),  # rank-1 experts; q/k/v biases stay frozen
    "glm4_moe_air_router_head": dict(rank=4, alpha=4.0, targets=lora.ROLES),
    "gpt_oss": dict(rank=4, alpha=8.0, expert_rank=2),  # q/k/v/o, router and expert biases and sinks stay frozen
    "gpt_oss_router_head": dict(rank=4, alpha=4.0, targets=lora.ROLES),
}


def randomise(model, seed=0, std=0.1):
    """Non-zero A and B everywhere, so a wrong layout, scaling or expert order changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in lora.lora_parameters(model):
            p.normal_(0.0, std, generator=g)


@pytest.fixture(scope="module", params=sorted(CASES))
def adapted(request, tmp_path_factory):
    case = request.param
    family = case.removesuffix("_router_head")
    hf = hf_model(CONFIGS[family])
    tmp = tmp_path_factory.mktemp(case)
    model = trillora.load_model(save_fused(hf, tmp / "base"))
    ids = tokens(hf.config.vocab_size)
    with torch.no_grad():
        base = model(ids)
    lora.apply_lora(model, lora.LoraConfig(**CASES[case]))
    randomise(model)
    with torch.no_grad():
        logits = model(ids)
    assert (logits - base).abs().max() > 0.1  # the adapter really acts
    return case, hf, model, ids, base, logits, tmp


def test_fused_layout_matches_peft(adapted):
    from peft import PeftModel

    case, hf, model, ids, base, logits, tmp = adapted
    path = lora.save_adapter(model, tmp / "fused", expert_layout="fused")
    config = json.loads((path / "adapter_config.json").read_text())
    assert (config["lora_alpha"], config["use_rslora"]) == (model.lora_config.alpha, model.lora_config.rslora)
    with warnings.catch_warnings():  # PEFT 0.21 says the patterns of target_parameters were ignored: they are not
        warnings.filterwarnings("ignore", "The following (rank|alpha)_pattern keys did not match")
        peft_model = PeftModel.from_pretrained(hf, str(path))
    experts = [m for n, m in peft_model.named_modules() if n.endswith("mlp.experts.base_layer")]  # gate_up's wrapper
    rank = model.lora_config.rank_for_experts(model.args.top_k)
    assert experts and all(m.r["default"] == 2 * rank for m in experts)  # the rank pattern applied
    assert all(
        m.scaling["default"] == pytest.approx(model.lora_config.scaling(model.lora_config.rank)) for m in experts
    )
    with torch.no_grad():
        ref = peft_model(ids).logits
    peft_model.unload()  # leave the module-scoped oracle as it was
    assert (logits - ref).abs().max().item() <= TOL


def test_per_expert_layout_matches_merged_transformers_reference(adapted):
    """Fold the per-expert file (A, B per expert, each module's scaling from the file's alpha and
    rank patterns as PEFT finds them) into a released-style checkpoint by hand; transformers runs
    its own per-expert loop over it."""
    from peft.utils.other import get_pattern_key

    case, hf, model, ids, base, logits, tmp = adapted
    if "router" in case:
        with pytest.raises(lora.AdapterError, match="router LoRA has no vLLM per-expert form"):
            lora.save_adapter(model, tmp / "per_expert", expert_layout="per_expert")
        return
    path = lora.save_adapter(model, tmp / "per_expert", expert_layout="per_expert")
    config = json.loads((path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (
        model.lora_config.rank,
        model.lora_config.alpha,
        model.lora_config.rslora,
    )  # the run's own, as the user configured them

    def scaling(module: str) -> float:
        r = config["rank_pattern"].get(get_pattern_key(config["rank_pattern"], module), config["r"])
        alpha = config["alpha_pattern"].get(get_pattern_key(config["alpha_pattern"], module), config["lora_alpha"])
        return alpha / r**0.5 if config["use_rslora"] else alpha / r

    adapter = load_file(str(path / "adapter_model.safetensors"))
    hf.save_pretrained(tmp / "released")  # per-expert names
    weights = load_file(str(tmp / "released" / "model.safetensors"))
    for key in [k for k in adapter if k.endswith("lora_A.weight")]:
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        delta = scaling(module) * adapter[key.replace("lora_A", "lora_B")] @ adapter[key]  # [out, in]
        stacked, _, proj = module.rpartition(".")
        expert = stacked.rpartition(".")[2]
        if case == "gpt_oss" and expert.isdigit():  # stacked [E, in, out] as released, gate/up columns interleaved
            e, experts = int(expert), stacked.rpartition(".")[0]
            if proj == "down_proj":
                weights[f"{experts}.down_proj"][e] += delta.T
            else:
                column = 0 if proj == "gate_proj" else 1  # gate in even columns, up in odd
                weights[f"{experts}.gate_up_proj"][e, :, column::2] += delta.T
            continue
        weights[f"{module}.weight"] = weights[f"{module}.weight"] + delta
    save_file(weights, str(tmp / "released" / "model.safetensors"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        tmp / "released", attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        assert (merged(ids).logits - logits).abs().max().item() <= TOL


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_roundtrip_through_our_loader(adapted, layout):
    case, hf, model, ids, base, logits, tmp = adapted
    if "router" in case and layout == "per_expert":
        pytest.skip("router LoRA is fused-layout only (checked above)")
    path = lora.save_adapter(model, tmp / f"rt-{layout}", expert_layout=layout)
    fresh = trillora.load_model(tmp / "base")
    lora.load_adapter(fresh, path)  # applies the saved LoraConfig first
    with torch.no_grad():
        assert (fresh(ids) - logits).abs().max().item() <= 1e-5


def test_merge_unmerge_and_adapter_off(adapted):
    case, hf, model, ids, base, logits, tmp = adapted
    with torch.no_grad():
        with lora.disable_adapter(model):
            assert torch.equal(model(ids), base)  # the reference policy is the base, bit for bit
        lora.merge(model)
        merged = model(ids)
        with pytest.raises(RuntimeError, match="unmerge"), lora.disable_adapter(model):
            pass
        lora.unmerge(model)
        after = model(ids)
    assert (merged - logits).abs().max().item() <= TOL
    assert (after - logits).abs().max().item() <= 1e-5


def test_peft_trained_fused_adapter_imports(tmp_path):
    """A PEFT adapter made by `get_peft_model` (shared A for gate and up, its own init) loads exactly."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    hf = hf_model(CONFIGS["qwen3_moe"])
    ids = tokens(hf.config.vocab_size)
    names = [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 2) for p in ("gate_up_proj", "down_proj")]
    pcfg = PeftLoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=names, init_lora_weights=False
    )
    pm = get_peft_model(hf, pcfg)
    with torch.no_grad():
        ref = pm(ids).logits
    pm.save_pretrained(tmp_path / "peft")
    pm.unload()
    ours = trillora.load_model(save_fused(hf, tmp_path / "base"))
    lora.apply_lora(ours, lora.LoraConfig(rank=4, alpha=8.0, targets=("experts",), patterns=("*.q_proj", "*.v_proj")))
    lora.load_adapter(ours, tmp_path / "peft")
    with torch.no_grad():
        assert (ours(ids) - ref).abs().max().item() <= TOL


def _tiny_model(name="qwen3_moe", **cfg):
    from trillora.models import build_model, from_hf_config

    model = build_model(from_hf_config(CONFIGS[name]), device="cpu")
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    lora.apply_lora(model, lora.LoraConfig(**cfg))
    return model


def test_starts_as_identity_and_only_lora_trains():
    model = _tiny_model(rank=4)
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        start = model(ids)
        with lora.disable_adapter(model):
            assert torch.equal(model(ids), start)  # B = 0 at init
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in lora.lora_parameters(model)} and trainable
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(ids).logsumexp(-1).mean().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n in frozen)  # no base weight gradients
    opt.step()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    with torch.no_grad():
        assert (model(ids) - start).abs().max() > 0  # the step moved the adapter


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss"])
def test_grouped_expert_lora_equals_loop(name):
    model = _tiny_model(name, rank=4, targets=("experts",))
    randomise(model, std=0.2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))

    def run(grouped):
        set_grouped_gemm(model, grouped)
        model.zero_grad()
        out = model(ids)
        out.square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in lora.lora_parameters(model)}

    (yg, gg), (yl, gl) = run(True), run(False)
    assert torch.allclose(yg, yl, atol=1e-5)
    for n in gg:
        assert torch.allclose(gg[n], gl[n], atol=1e-5, rtol=1e-4), n


def test_expert_lora_against_explicit_per_token_reference():
    """Each token through each chosen expert with W_e + s·B_e·A_e written out by hand."""
    model = _tiny_model(rank=4, targets=("experts",), alpha=6.0)
    randomise(model, std=0.2)
    m = next(mod for mod in model.modules() if isinstance(mod, LoraGroupedExperts))
    x = torch.randn(6, 64)
    idx = torch.tensor([[0, 3], [3, 5], [7, 0], [1, 2], [5, 5 - 1], [6, 7]])
    w = torch.rand(6, 2)
    s, inter = m.lora_scaling, m.hidden
    ref = torch.zeros(6, 64)
    with torch.no_grad():
        for t in range(6):
            for k in range(2):
                e = int(idx[t, k])
                gate_w = m.gate_up_proj[e, :inter] + s * m.lora_gate_B[e] @ m.lora_gate_A[e]
                up_w = m.gate_up_proj[e, inter:] + s * m.lora_up_B[e] @ m.lora_up_A[e]
                down_w = m.down_proj[e] + s * m.lora_down_B[e] @ m.lora_down_A[e]
                h = torch.nn.functional.silu(gate_w @ x[t]) * (up_w @ x[t])
                ref[t] += w[t, k] * (down_w @ h)
        assert torch.allclose(dispatch_combine(m, x, idx, w), ref, atol=1e-5)


def test_load_rejects_wrong_rank_and_missing_keys(tmp_path):
    model = _tiny_model(rank=4)
    randomise(model)
    path = lora.save_adapter(model, tmp_path / "a", expert_layout="per_expert")
    other = _tiny_model(rank=8)
    with pytest.raises(
        lora.AdapterError,
        match=r"'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' has shape \(4, 64\), the model's "
        r"adapter needs \(8, 64\)",
    ):
        lora.load_adapter(other, path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    del tensors["base_model.model.model.layers.2.mlp.experts.7.down_proj.lora_B.weight"]
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(
        lora.AdapterError, match="missing key 'base_model.model.model.layers.2.mlp.experts.7.down_proj.lora_B.weight'"
    ):
        lora.load_adapter(_tiny_model(rank=4), path)
    with pytest.raises(lora.AdapterError, match="missing adapter_config.json"):
        lora.load_adapter(model, tmp_path)


def test_non_finite_adapter_is_never_saved(tmp_path):
    model = _tiny_model(rank=4)
    with torch.no_grad():
        next(p for _, p in lora.lora_parameters(model)).fill_(float("nan"))
    with pytest.raises(lora.AdapterError, match="non-finite"):
        lora.save_adapter(model, tmp_path / "nan")
    assert not (tmp_path / "nan").exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rank=0), "lora.rank=0 is invalid; allowed: a positive integer"),
        (
            dict(targets=("attention", "ffn")),
            "lora.targets='ffn' is invalid; allowed: attention, mlp, shared_experts, experts, router, lm_head",
        ),
        (dict(expert_rank_rule="half"), "lora.expert_rank_rule='half' is invalid; allowed: same, divide_by_top_k"),
        (dict(dropout=1.0), "lora.dropout=1.0 is invalid"),
        (dict(dtype="fp8"), "lora.dtype='fp8' is invalid; allowed: float32, bfloat16, float16"),
    ],
)
def test_config_errors_name_key_and_allowed(kwargs, message):
    with pytest.raises(lora.LoraConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        lora.LoraConfig(**kwargs)


def test_targets_by_role_and_glob():
    from trillora.models import build_model, from_hf_config

    model = build_model(from_hf_config(CONFIGS["deepseek_v3"]), device="meta")
    t = lora.select_targets(model, lora.LoraConfig())
    assert (
        t["model.layers.0.self_attn.q_a_proj"] == "attention" and t["model.layers.0.self_attn.kv_b_proj"] == "attention"
    )
    assert (
        t["model.layers.0.mlp.gate_proj"] == "mlp"
        and t["model.layers.1.mlp.shared_experts.down_proj"] == "shared_experts"
    )
    assert t["model.layers.2.mlp.experts"] == "experts"
    assert "model.layers.1.mlp.gate" not in t and "lm_head" not in t  # router and head off by default
    only = lora.select_targets(
        model, lora.LoraConfig(targets=(), patterns=("*.o_proj",), exclude=("model.layers.0.*",))
    )
    assert sorted(only) == ["model.layers.1.self_attn.o_proj", "model.layers.2.self_attn.o_proj"]
    with pytest.raises(ValueError, match="match no module"):
        lora.apply_lora(model, lora.LoraConfig(targets=(), patterns=("nothing*",)))


def test_kimi_k2_rank_128_adapter_sizes():
    """The seed's setting, rank 128 on dense and expert layers of the real Kimi K2 config (meta device):
    8.0% of the base with rank 128 on every expert, 1.06% with expert rank 128 / top-8 = 16."""
    from trillora.models import build_model
    from trillora.models.params import resolve_args

    def stats(**cfg):
        model = build_model(resolve_args("kimi-k2"), device="meta")
        lora.apply_lora(model, lora.LoraConfig(rank=128, **cfg))
        return lora.adapter_stats(model)

    same, divided = stats(), stats(expert_rank_rule="divide_by_top_k")
    # per MoE layer the expert adapters are 384 experts x rank x (3 A of 7168 or 2048 in + 3 B of 2048 or 7168 out)
    assert same["expert_adapter_params"] == 60 * 384 * 128 * (2 * 7168 + 2048 + 2 * 2048 + 7168)
    assert divided["expert_adapter_params"] == same["expert_adapter_params"] // 8
    assert 0.079 < same["fraction"] < 0.081 and 0.0100 < divided["fraction"] < 0.0112


def test_fp32_adapter_on_bf16_base(tmp_path):
    hf = hf_model(CONFIGS["qwen3_moe"])
    model = trillora.load_model(save_fused(hf, tmp_path / "b"), dtype=torch.bfloat16)
    lora.apply_lora(model, lora.LoraConfig(rank=4, dtype="float32"))
    randomise(model)
    assert all(p.dtype == torch.float32 for _, p in lora.lora_parameters(model))
    ids = tokens(hf.config.vocab_size, length=10)
    out = model(ids)
    assert out.dtype == torch.bfloat16
    out.float().logsumexp(-1).mean().backward()
    grads = [p.grad for _, p in lora.lora_parameters(model)]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def test_dropout_only_in_training():
    model = _tiny_model(rank=4, dropout=0.5)
    randomise(model)
    ids = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        model.eval()
        assert torch.equal(model(ids), model(ids))
        model.train()
        assert not torch.equal(model(ids), model(ids))
