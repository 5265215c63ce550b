r"""Adapters on disk in PEFT layout (`adapter_config.json` + `adapter_model.safetensors`).

Two expert layouts, named explicitly because they differ in exactly the ways that cause bugs:

- `per_expert` (what vLLM loads for Qwen3-MoE / DeepSeek-V3 / Kimi K2):
  `base_model.model.{layer}.mlp.experts.{e}.{gate_proj|up_proj|down_proj}.lora_{A|B}.weight`,
  A [r, in], B [out, r].
- `fused` (PEFT `target_parameters` on transformers 5's stacked tensors):
  `...mlp.experts.base_layer.lora_{A|B}.weight` adapts `gate_up_proj` (inner wrapper) and
  `...mlp.experts.lora_{A|B}.weight` adapts `down_proj` (outer wrapper);
  A [E·r, in] is expert-major, B [out, E·r] has the expert index fastest.
  Our separate gate and up adapters (rank r each) become one block-diagonal rank-2r adapter.

gpt-oss differs in two places, as its stacked experts do in transformers: the router is
`mlp.router`, and the fused gate_up B has gate and up rows interleaved (its [E, C, 2I] weight
interleaves them column by column); PEFT's `is_transposed` experts take A and B as above.

The file says the run's `lora_alpha` and `use_rslora`. Every module trains at the dense
scaling whatever its rank (`apply_lora`), so a module of another rank (the fused rank-2r gate_up,
experts under an expert rank rule) gets an `alpha_pattern` entry that gives a reader the same
scaling: B is written as trained, and PEFT, vLLM and our loader compute one update. (PEFT 0.21
warns that the patterns of `target_parameters` "did not match any targeted module and were
ignored": its check looks at module targets only, and it says the same of the pattern its own
per-expert conversion adds. The patterns are applied: `tests/test_lora.py` checks the ranks and
logits of the adapter PEFT builds.)
Dense layers go through `target_parameters` too in the fused layout: PEFT rewrites
`gate_proj`/`up_proj`/`down_proj` module targets into expert parameters for these models.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..checkpoint.atomic import AtomicFolder
from ..checkpoint.hf import EXPERT_LAYOUTS
from ..errors import TrilloraError
from ..models import ReleaseLayout, release_of
from .apply import apply_lora, lora_modules
from .config import LoraConfig
from .layers import LoraGroupedExperts, LoraMixin, LoraRouterMixin

PREFIX = "base_model.model."


class AdapterError(TrilloraError, ValueError):
    """An adapter folder that does not fit the model; the message names the key or file."""


def _dense_tensors(name: str, m: LoraMixin) -> dict[str, torch.Tensor]:
    return {
        f"{PREFIX}{name}.lora_A.weight": m.lora_A.detach().float(),
        f"{PREFIX}{name}.lora_B.weight": m.lora_B.detach().float(),
    }


def _expert_tensors(name: str, m: LoraGroupedExperts, layout: str, release: ReleaseLayout) -> dict[str, torch.Tensor]:
    e = m.num_experts
    g_a, u_a, d_a = (t.detach().float() for t in (m.lora_gate_A, m.lora_up_A, m.lora_down_A))
    g_b, u_b, d_b = (t.detach().float() for t in (m.lora_gate_B, m.lora_up_B, m.lora_down_B))
    out: dict[str, torch.Tensor] = {}
    if layout == "per_expert":
        for i in range(e):
            for proj, a, b in (("gate_proj", g_a, g_b), ("up_proj", u_a, u_b), ("down_proj", d_a, d_b)):
                out[f"{PREFIX}{name}.{i}.{proj}.lora_A.weight"] = a[i].contiguous()
                out[f"{PREFIX}{name}.{i}.{proj}.lora_B.weight"] = b[i].contiguous()
        return out
    r, inter = m.lora_rank, m.hidden
    a_gu = torch.cat([g_a, u_a], dim=1)  # [E, 2r, C]
    b_gu = torch.zeros(e, 2 * inter, 2 * r)  # block diagonal: gate rows use the first r, up rows the last r
    b_gu[:, :inter, :r], b_gu[:, inter:, r:] = g_b, u_b
    out[f"{PREFIX}{name}.base_layer.lora_A.weight"] = a_gu.reshape(e * 2 * r, -1)  # expert-major
    b_gu = b_gu.permute(1, 2, 0).reshape(2 * inter, 2 * r * e)  # expert fastest
    out[f"{PREFIX}{name}.base_layer.lora_B.weight"] = release.gate_up_to_release(b_gu, dim=0)
    out[f"{PREFIX}{name}.lora_A.weight"] = d_a.reshape(e * r, -1)
    out[f"{PREFIX}{name}.lora_B.weight"] = d_b.permute(1, 2, 0).reshape(d_b.shape[1], r * e)
    return out


def vllm_layout(model: torch.nn.Module) -> str:
    """The expert layout vLLM reads for this model's family."""
    return release_of(model.args).vllm_expert_layout


def adapter_tensors(model: torch.nn.Module, layout: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, PEFT adapter_config) for the model's adapters in `layout`."""
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout={layout!r}; allowed: {', '.join(EXPERT_LAYOUTS)}")
    tensors: dict[str, torch.Tensor] = {}
    modules, parameters, ranks = set(), set(), {}
    cfg = model.lora_config
    base_rank, scaling = cfg.rank, cfg.scaling(cfg.rank)  # the file's scaling of every module
    release = release_of(model.args)
    for ours, m in lora_modules(model):
        name = release.module_name(ours)
        if m.lora_scaling != scaling:  # `apply_lora` gives every module the dense scaling; the file says it once
            raise AdapterError(f"{ours}: scaling {m.lora_scaling} is not the adapter's {scaling}; not saved")
        if isinstance(m, LoraGroupedExperts):
            tensors.update(_expert_tensors(name, m, layout, release))
            if layout == "per_expert":
                modules.update({"gate_proj", "up_proj", "down_proj"})
                if m.lora_rank != base_rank:
                    ranks[r"mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)"] = m.lora_rank
            else:
                parameters.update({f"{name}.gate_up_proj", f"{name}.down_proj"})
                ranks[re.escape(f"{name}.gate_up_proj")] = 2 * m.lora_rank
                if m.lora_rank != base_rank:
                    ranks[re.escape(f"{name}.down_proj")] = m.lora_rank
            continue
        if isinstance(m, LoraRouterMixin) and layout == "per_expert":
            raise AdapterError("router LoRA has no vLLM per-expert form; save with expert_layout='fused'")
        tensors.update(_dense_tensors(name, m))
        if layout == "per_expert":
            modules.add(name.rpartition(".")[2])
        elif isinstance(m, LoraRouterMixin) or ".mlp." in name:
            parameters.add(f"{name}.weight")  # see the module docstring: PEFT would remap *_proj module targets
        else:
            modules.add(name)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": base_rank,
        "lora_alpha": cfg.alpha,
        "rank_pattern": ranks,
        # a reader computes alpha / rank (alpha / sqrt(rank) with rsLoRA): the alpha that gives each
        # rank of the patterns the dense scaling
        "alpha_pattern": {k: scaling * (r**0.5 if cfg.rslora else r) for k, r in ranks.items()},
        "target_modules": sorted(modules),
        "target_parameters": sorted(parameters) or None,
        "lora_dropout": 0.0,
        "use_rslora": cfg.rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    return tensors, config


def save_adapter(
    model: torch.nn.Module,
    path: str | Path,
    expert_layout: str = "per_expert",
    base_model: str | None = None,
    base_fingerprint: str | None = None,
) -> Path:
    """Write the adapter atomically; refuses non-finite values so a NaN never reaches disk.
    `base_model`: what `adapter_config.json` names as the base (a Hub id or a folder);
    `base_fingerprint`: the base's `checkpoint.weights.base_fingerprint`, kept in
    `trillora_adapter.json` so a server can tell an adapter of another base."""
    tensors, config = adapter_tensors(model, expert_layout)
    bad = [k for k, t in tensors.items() if not torch.isfinite(t).all()]
    if bad:
        raise AdapterError(f"adapter has non-finite values in {bad[0]} (+{len(bad) - 1} more); not saved")
    config["base_model_name_or_path"] = base_model
    path = Path(path)
    with AtomicFolder(path) as tmp:
        # rank 1 makes some reshapes views with odd strides; safetensors wants packed tensors
        save_file(
            {k: t.contiguous() for k, t in tensors.items()},
            str(tmp / "adapter_model.safetensors"),
            metadata={"format": "pt"},
        )
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
        ours = {**dataclasses.asdict(model.lora_config), "expert_layout": expert_layout}
        if base_fingerprint is not None:
            ours["base_fingerprint"] = base_fingerprint
        (tmp / "trillora_adapter.json").write_text(json.dumps(ours, indent=2))
    return path


def _take(tensors: dict, key: str, shape: tuple[int, ...], where: Path) -> torch.Tensor:
    if key not in tensors:
        raise AdapterError(f"{where}: missing key {key!r}")
    t = tensors.pop(key)
    if tuple(t.shape) != shape:
        raise AdapterError(f"{where}: {key!r} has shape {tuple(t.shape)}, the model's adapter needs {shape}")
    return t


def adapter_config(path: str | Path) -> LoraConfig:
    """The LoraConfig an adapter folder was trained with (its `trillora_adapter.json`)."""
    meta = Path(path) / "trillora_adapter.json"
    if not meta.exists():
        raise AdapterError(f"{path}: no trillora_adapter.json, so the adapter's rank and targets are unknown")
    fields = json.loads(meta.read_text())
    fields.pop("expert_layout", None)
    fields.pop("base_fingerprint", None)
    for k in ("targets", "patterns", "exclude"):
        fields[k] = tuple(fields.get(k, ()))
    return LoraConfig(**fields)


def adapter_base(path: str | Path) -> str | None:
    """The fingerprint of the base an adapter folder was trained on (`base_fingerprint`), if it says."""
    meta = Path(path) / "trillora_adapter.json"
    return json.loads(meta.read_text()).get("base_fingerprint") if meta.exists() else None


def adapter_folder(path: str | Path) -> Path:
    """The adapter folder `path` names: itself, or for the folder a run writes (`runs/<name>/adapter`,
    holding both layouts) its `fused` layout."""
    path = Path(path)
    if not (path / "adapter_config.json").exists() and (path / "fused" / "adapter_config.json").exists():
        return path / "fused"
    return path


def load_adapter(model: torch.nn.Module, path: str | Path) -> torch.nn.Module:
    """Load an adapter saved in either layout (a run's `adapter/` folder: its fused one); adds
    adapters first if the model has none."""
    path = adapter_folder(path)
    if not any(True for _ in lora_modules(model)):
        _check_files(path)
        apply_lora(model, adapter_config(path))
    fill_adapter(lora_modules(model), path, release_of(model.args))
    return model


def _check_files(path: Path) -> None:
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        if not (path / f).exists():
            raise AdapterError(
                f"{path}: missing {f} (trillora train writes runs/<name>/adapter/fused and .../per_expert)"
            )


@torch.no_grad()
def fill_adapter(modules, path: str | Path, release: ReleaseLayout | None = None) -> None:
    """Copy an adapter folder's tensors into the LoRA tensors of `modules` ((name, module) pairs,
    already shaped for it); every tensor of the file must land in one of them. `release`: the
    family's names and layout (`release_of(model.args)`; ours when None)."""
    path, release = Path(path), release or ReleaseLayout()
    _check_files(path)
    config = json.loads((path / "adapter_config.json").read_text())
    tensors = load_file(str(path / "adapter_model.safetensors"))
    file_scale = _file_scaling(config)
    fused = any(".experts.base_layer.lora_A" in k for k in tensors)
    for ours, m in modules:
        name = release.module_name(ours)
        if isinstance(m, LoraGroupedExperts):
            _load_experts(name, m, tensors, fused, file_scale, path, release)
            continue
        a = _take(tensors, f"{PREFIX}{name}.lora_A.weight", tuple(m.lora_A.shape), path)
        b = _take(tensors, f"{PREFIX}{name}.lora_B.weight", tuple(m.lora_B.shape), path)
        m.lora_A.copy_(a)
        m.lora_B.copy_(b * file_scale(name, m.lora_rank) / m.lora_scaling)
    if tensors:
        raise AdapterError(f"{path}: keys with no adapter in this model: {sorted(tensors)[:4]}")


def _file_scaling(config: dict):
    """scaling(module name, rank) as a PEFT reader of this config computes it."""
    alpha, r = float(config["lora_alpha"]), int(config["r"])
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora"))

    def find(patterns: dict, key: str, default):
        for pattern, value in patterns.items():
            if re.match(rf"(.*\.)?({pattern})$", key):
                return value
        return default

    def scaling(key: str, _rank: int) -> float:
        rk, al = int(find(rank_pattern, key, r)), float(find(alpha_pattern, key, alpha))
        return al / rk**0.5 if rslora else al / rk

    return scaling


def _load_experts(name, m: LoraGroupedExperts, tensors, fused, file_scale, where, release: ReleaseLayout) -> None:
    e, r, inter, c = m.num_experts, m.lora_rank, m.hidden, m.down_proj.shape[1]
    s = m.lora_scaling
    if not fused:
        for i in range(e):
            for proj, a_p, b_p, n_in, n_out in (
                ("gate_proj", m.lora_gate_A, m.lora_gate_B, c, inter),
                ("up_proj", m.lora_up_A, m.lora_up_B, c, inter),
                ("down_proj", m.lora_down_A, m.lora_down_B, inter, c),
            ):
                key = f"{name}.{i}.{proj}"
                a_p[i].copy_(_take(tensors, f"{PREFIX}{key}.lora_A.weight", (r, n_in), where))
                b_p[i].copy_(_take(tensors, f"{PREFIX}{key}.lora_B.weight", (n_out, r), where) * file_scale(key, r) / s)
        return
    gu_key, d_key = f"{PREFIX}{name}.base_layer", f"{PREFIX}{name}"
    a_gu = tensors.get(f"{gu_key}.lora_A.weight")
    if a_gu is None:
        raise AdapterError(f"{where}: missing key {gu_key + '.lora_A.weight'!r}")
    rank_gu = a_gu.shape[0] // e
    if rank_gu not in (r, 2 * r):
        raise AdapterError(
            f"{where}: fused gate_up adapter of {name} has rank {rank_gu}; this model's expert rank is {r} (accepts "
            f"{r} or {2 * r})"
        )
    a_gu = _take(tensors, f"{gu_key}.lora_A.weight", (e * rank_gu, c), where).view(e, rank_gu, c)
    b_gu = _take(tensors, f"{gu_key}.lora_B.weight", (2 * inter, e * rank_gu), where)
    b_gu = release.gate_up_from_release(b_gu, dim=0)
    b_gu = b_gu.view(2 * inter, rank_gu, e).permute(2, 0, 1) * (
        file_scale(f"{name}.gate_up_proj", rank_gu) / s
    )  # [E, 2I, R]
    if rank_gu == 2 * r:  # block diagonal, as we write it
        off = torch.cat([b_gu[:, :inter, r:], b_gu[:, inter:, :r]]).abs().max()
        if off > 0:
            raise AdapterError(
                f"{where}: fused gate_up adapter of {name} is not block-diagonal; it needs expert rank {2 * r}"
            )
        m.lora_gate_A.copy_(a_gu[:, :r]), m.lora_up_A.copy_(a_gu[:, r:])
        m.lora_gate_B.copy_(b_gu[:, :inter, :r]), m.lora_up_B.copy_(b_gu[:, inter:, r:])
    else:  # one shared A for gate and up (e.g. trained by PEFT): exact with A_gate = A_up = A
        m.lora_gate_A.copy_(a_gu), m.lora_up_A.copy_(a_gu)
        m.lora_gate_B.copy_(b_gu[:, :inter]), m.lora_up_B.copy_(b_gu[:, inter:])
    m.lora_down_A.copy_(_take(tensors, f"{d_key}.lora_A.weight", (e * r, inter), where).view(e, r, inter))
    b_d = _take(tensors, f"{d_key}.lora_B.weight", (c, e * r), where).view(c, r, e).permute(2, 0, 1)
    m.lora_down_B.copy_(b_d * file_scale(f"{name}.down_proj", r) / s)
