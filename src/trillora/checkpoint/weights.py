"""Streaming a checkpoint's tensors into an allocated model: each tensor read once, straight into
its parameter (or this rank's part of it), fp8 weights dequantised on the way, and the family's
release layout (`models/<family>/state_dict.py`) undone.

With `experts=(rank, size)` a rank reads only its slice of the routed experts; tensors of modules
another pipeline stage holds (`OtherStage`) are not read; a tensor-parallel DTensor parameter
takes its own chunk of each tensor. Expert weights come either per expert
(`experts.{e}.gate_proj.weight`, as released) or fused (`experts.gate_up_proj`, as transformers 5
holds them); both land in the same stacked parameters.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..errors import TrilloraError
from ..models import CausalLM, release_of
from ..models.layers import local
from ..models.transformer import OtherStage
from .fp8 import dequantize_blockwise

INDEX = "model.safetensors.index.json"
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
        self.expert_params = {
            f"{n}.{p}"
            for n, m in model.named_modules()
            if isinstance(m, GroupedExperts)
            for p, _ in m.named_parameters(recurse=False)
        }
        self.targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=True))
        self.targets.update(dict(model.named_buffers()))
        persistent = set(model.state_dict().keys())
        # adapter slots a service put on the model before allocating it are not in a base checkpoint
        self.targets = {
            k: v for k, v in self.targets.items() if k in persistent and not k.rpartition(".")[2].startswith("lora_")
        }
        self.elsewhere = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, OtherStage))
        """Modules another pipeline stage holds: their tensors are not read."""
        self.filled: dict[str, int] = defaultdict(int)

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
            return  # multi-token-prediction layers follow the decoder layers
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
                tensor = tensor[self.rows.start : self.rows.stop]
        dest = self.targets[target][index] if index else self.targets[target]
        if isinstance(dest, DTensor):  # a tensor-parallel weight: this rank's part
            if tuple(dest.shape) != tuple(tensor.shape):
                raise CheckpointError(
                    f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(dest.shape)}"
                )
            tensor, dest = _local_part(tensor, dest), dest.to_local()
        if tuple(dest.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(dest.shape)}"
            )
        dest.copy_(tensor.to(dest.dtype))
        self.filled[target] += tensor.numel()

    def check_complete(self, path: Path) -> None:
        missing = [k for k, t in self.targets.items() if self.filled[k] < local(t).numel()]
        if missing:
            shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
            raise CheckpointError(f"{path}: checkpoint lacks weights for {shown}")


def _local_part(whole: torch.Tensor, dest: DTensor) -> torch.Tensor:
    """The block of `whole` that `dest`'s rank holds: tensor-parallel chunks, and FSDP's chunks of
    those on a 2-D mesh (each a contiguous block, where DTensor puts its offset)."""
    shape, offset = compute_local_shape_and_global_offset(whole.shape, dest.device_mesh, dest.placements)
    return whole[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]


def load_weights(
    model: CausalLM, path: str | Path, block: int | None = None, experts: tuple[int, int] | None = None
) -> None:
    """Stream every tensor of the checkpoint at `path` into `model` (already materialised; with
    `experts=(rank, size)` its routed experts already cut to that rank's slice)."""
    path = Path(path)
    if block is None:
        quant = model.args.hf_config.get("quantization_config") or {}
        block = int((quant.get("weight_block_size") or [128])[0])
    filler = _Filler(model, experts)
    release = release_of(model.args)
    pending: dict[str, torch.Tensor] = {}  # quantised weights or scales waiting for their partner (another shard)
    for file in shard_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors file handle is not iterable
                if not filler.wanted(name):
                    continue
                tensor = f.get_tensor(name)
                if name.endswith(".weight_scale_inv"):
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
                else:  # the family's release layout (gpt-oss: MXFP4 experts, transposed and interleaved)
                    for ours, value in release.from_release(name, tensor, pending):
                        filler.put(ours, value, file.name)
    if pending:
        raise CheckpointError(
            f"{path}: quantised tensors without their scales (or scales without weights): {sorted(pending)[:4]}"
        )
    filler.check_complete(path)


def base_fingerprint(path: str | Path) -> str:
    """A short id of a checkpoint's weights, for telling which base an adapter was trained on: a
    sha256 over every shard's safetensors header (names, shapes, dtypes, offsets) and the first
    and last 64 bytes of each tensor's data. Reads a few bytes per tensor, not the weights, and is
    the same wherever the folder lies (a copy, the Hub cache, another machine)."""
    import hashlib
    import struct

    digest = hashlib.sha256()
    for file in shard_files(Path(path)):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = f.read(size)
            digest.update(header)
            for name, info in sorted(json.loads(header).items()):
                if name == "__metadata__":
                    continue
                start, end = info["data_offsets"]
                for offset in sorted({start, max(start, end - 64)}):
                    f.seek(8 + size + offset)
                    digest.update(f.read(min(64, end - offset)))
    return digest.hexdigest()[:16]
