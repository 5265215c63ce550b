"""Merged-weight sync into a running vLLM engine: push only the tensors the adapter changes.

Two halves. `merged_tensors` runs in the trainer: base + scaling·B·A for every tensor an
adapter touches, under Hugging Face checkpoint names with experts split per expert (the
format vLLM's loaders read), plus the untouched siblings vLLM keeps fused with them (q/k/v
live in one `qkv_proj`, gate/up in one `gate_up_proj`), so every vLLM tensor we write is
written whole. `load_merged` runs inside vLLM's worker (through `collective_rpc`, or
`WeightSyncExtension` for a server started with `--worker-extension-cls`).

On GPU the worker uses vLLM's own in-place `reload_weights`. On CPU that path leaves the
prepacked MoE weights wrong (measured: reloading the unchanged base checkpoint changed the
greedy tokens), and CPU linear layers keep only a packed copy of their weight, so there
we write each layer ourselves: rebuild the checkpoint-format tensor, let vLLM's own
`process_weights_after_loading` repack linear layers, and prepack expert weights with the
kernel vLLM chose, into the same storage the running engine reads.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.hf import expert_tensors_per_expert
from ..errors import TrilloraError
from ..lora.apply import lora_modules
from ..models import release_of

GROUPS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""vLLM's fused projections and the projections they hold, in order."""
SIBLINGS = {leaf: leaves for leaves in GROUPS.values() for leaf in leaves}
FUSED = {leaf: (fused, i) for fused, leaves in GROUPS.items() for i, leaf in enumerate(leaves)}
EXPERT = re.compile(r"^(?P<moe>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


# --- trainer side --------------------------------------------------------------------------
@torch.no_grad()
def merged_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """{HF checkpoint name: merged tensor} for every tensor an adapter changes, and the siblings
    vLLM fuses with them. Experts come per expert: `...experts.{e}.{gate|up|down}_proj.weight`."""
    out: dict[str, torch.Tensor] = {}
    release = release_of(model.args)
    for ours, m in lora_modules(model):
        name = release.module_name(ours)  # gpt-oss's router is `mlp.router`
        for tensor_name, delta in m.delta().items():
            base = getattr(m, tensor_name)
            merged = (base if m.lora_merged else base + delta.to(base.dtype)).detach()
            out.update(expert_tensors_per_expert(f"{name}.{tensor_name}", merged))  # experts split as released
            if tensor_name not in ("gate_up_proj", "down_proj"):
                parent, _, leaf = name.rpartition(".")
                for sib in SIBLINGS.get(leaf, ()):
                    key = f"{parent}.{sib}.{tensor_name}"
                    if key not in out:
                        out[key] = (
                            model.get_submodule(f"{parent}.{sib}").get_parameter(tensor_name).detach().contiguous()
                        )
    return out


# --- worker side ---------------------------------------------------------------------------
class SyncError(TrilloraError, RuntimeError):
    """A tensor the running vLLM model has no place for; the message names it."""


def _group(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """HF names -> {vLLM module path: pieces}: fused linears by shard index, experts by index."""
    groups: dict[str, dict] = {}
    for name, t in tensors.items():
        m = EXPERT.match(name)
        if m:
            g = groups.setdefault(m["moe"], {"kind": "experts", "gate": {}, "up": {}, "down": {}})
            g[m["proj"].removesuffix("_proj")][int(m["e"])] = t
            continue
        module, _, param = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        if leaf in FUSED and param == "weight":
            fused, index = FUSED[leaf]
            g = groups.setdefault(f"{parent}.{fused}", {"kind": "fused", "parts": {}, "need": len(SIBLINGS[leaf])})
            g["parts"][index] = t
        else:
            groups.setdefault(module, {"kind": "plain", "params": {}})["params"][param] = t
    return groups


def _find(model: nn.Module, path: str) -> nn.Module:
    mapper = getattr(model, "hf_to_vllm_mapper", None)  # e.g. gpt-oss: vLLM names `self_attn` `attn`
    for old, new in (getattr(mapper, "orig_to_new_substr", None) or {}).items():
        path = path.replace(old, new)
    try:
        module = model.get_submodule(path)
    except AttributeError:
        raise SyncError(
            f"vLLM's model has no module {path!r} to take merged weights; use adapter sync for it"
        ) from None
    return getattr(module, "routed_experts", module)  # vLLM wraps routed experts in a runner


def _write_linear(module: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Give the layer its checkpoint-format tensors and let vLLM process them (on CPU this
    repacks the weight into the layer's GEMM); keep the original storage where the processed
    tensor has its shape, since the running engine may hold references to it."""
    old = {n: module.get_parameter(n) for n in params}
    for n, t in params.items():
        module.register_parameter(n, nn.Parameter(t.to(old[n].dtype).to(old[n].device).clone(), requires_grad=False))
    quant = getattr(module, "quant_method", None)
    if quant is not None:
        quant.process_weights_after_loading(module)
    for n, p in old.items():
        new = module.get_parameter(n)
        if new.shape == p.shape and new.dtype == p.dtype:
            p.data.copy_(new.data)
            module.register_parameter(n, p)


def _write_experts(module: nn.Module, path: str, g: dict) -> None:
    w13, w2 = module.w13_weight, module.w2_weight  # [E, 2P, C], [E, C, P]; P = intermediate (maybe padded)
    n_exp = w13.shape[0]
    missing = [e for e in range(n_exp) if not all(e in g[k] for k in ("gate", "up", "down"))]
    if missing:
        raise SyncError(f"{path}: merged sync needs gate/up/down of all {n_exp} experts; missing expert {missing[0]}")
    inter, pad = g["gate"][0].shape[0], w2.shape[2]
    interleaved = str(getattr(module, "activation", "")).lower().endswith("swigluoai")  # gpt-oss: g0, u0, g1, u1, ...
    new13 = w13.new_zeros(w13.shape)
    new2 = w2.new_zeros(w2.shape)
    for e in range(n_exp):
        if interleaved:
            new13[e, 0 : 2 * inter : 2], new13[e, 1 : 2 * inter : 2] = g["gate"][e], g["up"][e]
        else:
            new13[e, :inter] = g["gate"][e]
            new13[e, pad : pad + inter] = g["up"][e]
        new2[e, :, :inter] = g["down"][e]
    kernel = getattr(module.quant_method, "moe_kernel", None)
    experts = getattr(getattr(kernel, "impl", kernel), "fused_experts", None)
    if w13.device.type == "cpu" and hasattr(experts, "isa") and not getattr(experts, "_use_zentorch", False):
        from vllm._custom_ops import cpu_prepack_moe_weight  # the layout vLLM's CPU MoE kernel reads

        new13, new2 = cpu_prepack_moe_weight(new13, experts.isa), cpu_prepack_moe_weight(new2, experts.isa)
    w13.data.copy_(new13)
    w2.data.copy_(new2)


def load_merged(worker, tensors: dict[str, torch.Tensor]) -> int:
    """Write merged tensors into the worker's running model; returns how many were written.
    Called by vLLM as `collective_rpc(load_merged, args=(tensors,))` (`worker` is vLLM's worker)."""
    runner = worker.model_runner
    model = runner.model if hasattr(runner, "model") else runner.get_model()
    device = next(model.parameters()).device
    if device.type != "cpu":
        runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        return len(tensors)
    with torch.no_grad():
        for path, g in _group(tensors).items():
            module = _find(model, path)
            if g["kind"] == "experts":
                _write_experts(module, path, g)
            elif g["kind"] == "fused":
                if len(g["parts"]) != g["need"]:
                    raise SyncError(f"{path}: merged sync needs all {g['need']} fused parts, got {sorted(g['parts'])}")
                _write_linear(module, {"weight": torch.cat([g["parts"][i] for i in range(g["need"])], dim=0)})
            else:
                _write_linear(module, g["params"])
    return len(tensors)


SYNC_DIR_ENV = "TRILLORA_SYNC_DIR"


def allowed_sync_file(path: str) -> Path | str:
    """The merged-tensor file to load, or why it is refused: only `.safetensors` files inside the
    folder `TRILLORA_SYNC_DIR` names (the trainer's `rollout.sync_dir`). vLLM's `/collective_rpc`
    sits outside the routes its `--api-key` guards (`/v1`, ...), so whoever reaches the port can
    call it: without this a caller could load any file on the server into the live weights."""
    import os

    root = os.environ.get(SYNC_DIR_ENV)
    if not root:
        return f"refused: set {SYNC_DIR_ENV} in the server's environment to the trainer's rollout.sync_dir"
    want, base = Path(path).resolve(), Path(root).resolve()
    if base not in want.parents or want.suffix != ".safetensors":
        return f"refused: {path!r} is not a .safetensors file inside {SYNC_DIR_ENV}={root!r}"
    return want


class WeightSyncExtension:
    """Mixed into vLLM's worker by `--worker-extension-cls trillora.rollout.vllm_sync.WeightSyncExtension`.
    With `VLLM_SERVER_DEV_MODE=1` the server's `/collective_rpc` endpoint then reaches
    `trillora_load_merged(path)`: the trainer writes the merged tensors to a safetensors file on a
    shared filesystem and names it (the endpoint carries strings only). A refused path comes back
    as the result string (raising inside the worker would take the engine down)."""

    def trillora_load_merged(self, path: str) -> int | str:
        from safetensors.torch import load_file

        found = allowed_sync_file(path)
        if isinstance(found, str):
            return found
        return load_merged(self, load_file(str(found)))
