"""Hugging Face checkpoint folders in and out: config.json, (sharded) safetensors, tokenizer files.

Loading builds the model on the meta device, allocates it once, and streams
tensors shard by shard into the allocated parameters, so a checkpoint never
lives twice in memory. With `experts=(rank, size)` a rank allocates and reads only its slice
of the routed experts (expert parallelism's), so it never holds the others. Expert weights come either per expert
(`experts.{e}.gate_proj.weight`, as released) or fused (`experts.gate_up_proj`,
as transformers 5 holds them); both land in the same stacked parameters.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import defaultdict
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Literal, get_args

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import MissingPath, TrilloraError
from ..models import CausalLM, ModelArgs, build_model, load_hf_config
from ..models.transformer import OtherStage, keep_stage
from .atomic import AtomicFolder
from . import gpt_oss
from .fp8 import dequantize_blockwise

INDEX = "model.safetensors.index.json"
ExpertLayout = Literal["per_expert", "fused"]
"""Stacked experts on disk: one tensor per expert and projection as released (vLLM's adapter names
too), or fused `gate_up_proj` / `down_proj` as transformers 5 (and PEFT's `target_parameters`) hold them."""
EXPERT_LAYOUTS: tuple[str, ...] = get_args(ExpertLayout)
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")  # derived buffer some old checkpoints carry


class CheckpointError(TrilloraError, ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file or key."""


def shard_files(path: Path) -> list[Path]:
    index = path / INDEX
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    elif (path / "model.safetensors").exists():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no safetensors weights (expected {INDEX} or model.safetensors)")
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{path}: shard {f.name} named in {INDEX} is missing")
    return files


class _Filler:
    """Copies checkpoint tensors into the model's allocated parameters and tracks coverage."""

    def __init__(self, model: CausalLM, experts: tuple[int, int] | None = None):
        from ..models.moe import GroupedExperts

        self.model = model
        self.args = model.args
        self.rows = None  # this rank's routed experts, when it holds only them
        if experts is not None:
            local = self.args.num_experts // experts[1]
            self.rows = range(experts[0] * local, (experts[0] + 1) * local)
        self.expert_params = {f"{n}.{p}" for n, m in model.named_modules() if isinstance(m, GroupedExperts)
                              for p, _ in m.named_parameters(recurse=False)}
        self.targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=True))
        self.targets.update(dict(model.named_buffers()))
        persistent = set(model.state_dict().keys())
        self.targets = {k: v for k, v in self.targets.items() if k in persistent}
        self.elsewhere = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, OtherStage))
        """Modules another pipeline stage holds: their tensors are not read."""
        self.filled: dict[str, int] = defaultdict(int)
        self.skipped_mtp = 0

    def wanted(self, name: str) -> bool:
        """False for another rank's per-expert tensor (or its fp8 scale), or another pipeline stage's
        tensor: not even read."""
        if self.elsewhere and name.startswith(self.elsewhere):
            return False
        expert = _PER_EXPERT.match(name.removesuffix("_scale_inv"))
        return self.rows is None or expert is None or int(expert.group(2)) in self.rows

    @torch.no_grad()
    def put(self, name: str, tensor: torch.Tensor, where: str) -> None:
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= self.args.num_layers:
            self.skipped_mtp += 1  # multi-token-prediction layers follow the decoder layers
            return
        if _IGNORED.search(name):
            return
        target, index = name, ()
        expert = _PER_EXPERT.match(name)
        if expert:
            prefix, e, proj = expert.group(1), int(expert.group(2)), expert.group(3)
            hidden = self.args.moe_intermediate_size
            if proj == "down_proj":
                target, index = f"{prefix}.down_proj", (e,)
            else:
                rows = slice(0, hidden) if proj == "gate_proj" else slice(hidden, 2 * hidden)
                target, index = f"{prefix}.gate_up_proj", (e, rows)
        if target not in self.targets:
            raise CheckpointError(f"{where}: tensor {name!r} has no place in a {self.args.model_type} model")
        if self.rows is not None and target in self.expert_params:  # only this rank's experts
            if index:
                if index[0] not in self.rows:
                    return
                index = (index[0] - self.rows.start, *index[1:])
            elif tensor.shape[0] == self.args.num_experts:
                tensor = tensor[self.rows.start:self.rows.stop]
        dest = self.targets[target][index] if index else self.targets[target]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(dest.shape)}"
            )
        dest.copy_(tensor.to(dest.dtype))
        self.filled[target] += tensor.numel()

    def check_complete(self, path: Path) -> None:
        missing = [k for k, t in self.targets.items() if self.filled[k] < t.numel()]
        if missing:
            shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
            raise CheckpointError(f"{path}: checkpoint lacks weights for {shown}")


def load_weights(model: CausalLM, path: str | Path, block: int | None = None,
                 experts: tuple[int, int] | None = None) -> None:
    """Stream every tensor of the checkpoint at `path` into `model` (already materialised; with
    `experts=(rank, size)` its routed experts already cut to that rank's slice)."""
    path = Path(path)
    if block is None:
        quant = model.args.hf_config.get("quantization_config") or {}
        block = int((quant.get("weight_block_size") or [128])[0])
    filler = _Filler(model, experts)
    released = model.args.family == "gpt_oss"
    pending: dict[str, torch.Tensor] = {}  # fp8 / mxfp4 weights or scales waiting for their partner (other shard)
    for file in shard_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if not filler.wanted(name):
                    continue
                tensor = f.get_tensor(name)
                if released and name.endswith(("_blocks", "_scales")):  # gpt-oss MXFP4 experts
                    base, _, kind = name.rpartition("_")
                    partner = f"{base}_{'scales' if kind == 'blocks' else 'blocks'}"
                    if partner not in pending:
                        pending[name] = tensor
                        continue
                    blocks, scales = (tensor, pending.pop(partner)) if kind == "blocks" else (pending.pop(partner), tensor)
                    for part, value in gpt_oss.mxfp4_experts(base, blocks, scales):
                        filler.put(part, value, file.name)
                elif released:
                    filler.put(*gpt_oss.from_release(name, tensor), file.name)
                elif name.endswith(".weight_scale_inv"):
                    wname = name[: -len("_scale_inv")]
                    if wname not in pending:
                        pending[name] = tensor
                        continue
                    filler.put(wname, dequantize_blockwise(pending.pop(wname), tensor, block), file.name)
                elif tensor.dtype == torch.float8_e4m3fn:
                    scale = pending.pop(name + "_scale_inv", None)
                    if scale is None:
                        pending[name] = tensor
                        continue
                    filler.put(name, dequantize_blockwise(tensor, scale, block), file.name)
                else:
                    filler.put(name, tensor, file.name)
    if pending:
        raise CheckpointError(f"{path}: quantised tensors without their scales (or scales without weights): {sorted(pending)[:4]}")
    filler.check_complete(path)


SHIPPED_MODELS = ("tiny-moe", "tiny-moe-chat")
"""Checkpoints inside the package, loadable by name (no download)."""


def resolve_model_path(path: str | Path) -> Path:
    """A checkpoint folder, or the folder of a model shipped with trillora (`tiny-moe`, `tiny-moe-chat`)."""
    if str(path) in SHIPPED_MODELS:
        return Path(str(resources.files("trillora").joinpath(f"assets/{path}")))
    return Path(path)


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    experts: tuple[int, int] | None = None, layers: range | None = None,
) -> CausalLM:
    """A model from a Hugging Face folder (config.json + safetensors), weights in `dtype` on `device`;
    `tiny-moe` loads the shipped one. `experts=(rank, size)`: only routed experts
    [rank·E/size, (rank+1)·E/size) are allocated and read, as `parallel.expert_parallel` keeps them.
    `layers`: only a pipeline stage's decoder layers (and the embedding or the head if the stage
    begins or ends the model) are allocated and read; the rest are `OtherStage` placeholders."""
    from ..models.moe import GroupedExperts, shard_experts

    path = resolve_model_path(path)
    if not path.is_dir():
        raise MissingPath(f"{path}: not a checkpoint folder")
    args, _ = load_hf_config(path)
    model = build_model(args, device="meta", dtype=dtype)
    if experts is not None:
        if not args.num_experts or args.num_experts % experts[1] or not 0 <= experts[0] < experts[1]:
            raise CheckpointError(f"{path}: cannot keep experts slice {experts[0]} of {experts[1]} "
                                  f"(num_experts={args.num_experts})")
        for m in model.modules():
            if isinstance(m, GroupedExperts):
                shard_experts(m, *experts)  # on meta: nothing allocated yet
    if layers is not None:
        if not (0 <= layers.start < layers.stop <= args.num_layers):
            raise CheckpointError(f"{path}: cannot keep layers {layers.start}..{layers.stop - 1} of {args.num_layers}")
        keep_stage(model, layers)
    model.to_empty(device=device)
    if args.tie_word_embeddings and layers is None:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.reset_buffers()
    for m in model.modules():  # routing bias stays fp32 whatever the weights' dtype
        if hasattr(m, "e_score_correction_bias"):
            m.e_score_correction_bias.data = m.e_score_correction_bias.data.float()
    load_weights(model, path, experts=experts)
    return model.eval()


def expert_tensors_per_expert(name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked expert tensor under released (per-expert) names: `...experts.gate_up_proj`
    [E, 2I, C] -> `...experts.{e}.gate_proj.weight` / `up_proj.weight`, `down_proj` [E, C, I] ->
    `...experts.{e}.down_proj.weight`; any other tensor unchanged."""
    if name.endswith(".experts.gate_up_proj"):
        prefix, inter = name[: -len(".gate_up_proj")], t.shape[1] // 2
        for e in range(t.shape[0]):
            yield f"{prefix}.{e}.gate_proj.weight", t[e, :inter].contiguous()
            yield f"{prefix}.{e}.up_proj.weight", t[e, inter:].contiguous()
    elif name.endswith(".experts.down_proj"):
        prefix = name[: -len(".down_proj")]
        for e in range(t.shape[0]):
            yield f"{prefix}.{e}.down_proj.weight", t[e].contiguous()
    else:
        yield name, t.contiguous()


def hf_state_dict(model: CausalLM, expert_layout: str = "fused") -> dict[str, torch.Tensor]:
    """The model's tensors under Hugging Face names; `per_expert` splits stacked experts as released."""
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout={expert_layout!r}; allowed: {', '.join(EXPERT_LAYOUTS)}")
    released = model.args.family == "gpt_oss"
    if released and expert_layout == "per_expert":
        raise CheckpointError("gpt-oss checkpoints have one expert layout (stacked, as released and as transformers "
                              "loads them); use expert_layout='fused'")
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if model.args.tie_word_embeddings and name == "lm_head.weight":
            continue
        t = t.detach()
        if released:
            out.update([gpt_oss.to_release(name, t)])
        else:
            out.update(expert_tensors_per_expert(name, t) if expert_layout == "per_expert" else [(name, t.contiguous())])
    return out


def save_model(
    model: CausalLM,
    path: str | Path,
    expert_layout: str = "fused",
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    tokenizer_from: str | Path | None = None,
) -> Path:
    """Write a Hugging Face folder that transformers (and trillora) load; atomic: all or nothing."""
    path = Path(path)
    tensors = hf_state_dict(model, expert_layout)
    if dtype is not None:
        tensors = {k: v if k.endswith("e_score_correction_bias") else v.to(dtype) for k, v in tensors.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    with AtomicFolder(path) as tmp:
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({k: fname for k in shard})
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        config = _config_for_save(model.args, dtype or next(iter(tensors.values())).dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if tokenizer_from is not None:
            copy_tokenizer(Path(tokenizer_from), tmp)
    return path


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


def _config_for_save(args: ModelArgs, dtype: torch.dtype) -> dict:
    config = dict(args.hf_config)
    config.pop("quantization_config", None)  # weights are written dequantised
    config["dtype"] = str(dtype).removeprefix("torch.")
    return config


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """The checkpoint's own tokenizer, through transformers; names the folder when files are missing.

    Some releases ship their tokenizer as code (Kimi K2: a tiktoken model read by
    `tokenization_kimi.py`, named in `tokenizer_config.json`'s `auto_map`). That code runs only
    when the user says so (`model.trust_remote_code`); otherwise the error names the file."""
    import json

    from transformers import AutoTokenizer

    path = resolve_model_path(path)
    if not any((path / n).exists() for n in TOKENIZER_FILES):
        raise CheckpointError(f"{path}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})")
    config = path / "tokenizer_config.json"
    auto_map = json.loads(config.read_text()).get("auto_map", {}) if config.is_file() else {}
    code = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    if code and not trust_remote_code:
        module = str(code[0] if isinstance(code, list) else code).split(".")[0]
        raise CheckpointError(f"{config}: the tokenizer is code ({module}.py, auto_map.AutoTokenizer); read it, then "
                              "allow it with model.trust_remote_code=true (train) or --trust-remote-code (serve, eval, generate)")
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=bool(code) and trust_remote_code)


def check_tokenizer_fits(tokenizer, vocab_size: int, path: str | Path) -> None:
    """A tokenizer with ids past the model's embedding rows belongs to another model: say so at
    load, not as an IndexError in the first forward. (Fewer ids than rows is normal: padding.)"""
    if len(tokenizer) > vocab_size:
        raise CheckpointError(f"{path}: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                              f"{vocab_size} (config.json): they are not one model's")
