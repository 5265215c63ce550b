"""Training checkpoints: everything a run needs to continue as if it had never stopped.

A checkpoint is a folder `checkpoints/step-{N:06d}` holding, per rank, the local LoRA tensors,
AdamW state and torch RNG state (`rank-{r}.safetensors`, so sharded layouts save without
gathering and without pickle), and from rank 0 `state.json` (step, Python and NumPy RNG states,
counters, the layout), `metrics.jsonl` up to that step, `config.toml`, the adapter in PEFT
layout (`adapter/`, for people: vLLM and PEFT read it) and `manifest.json` (size and SHA-256 of
every file). It is written into `.step-{N}.partial`, fsynced, and renamed into place; the
`latest` file is rewritten (temp + rename) only after that. So a kill at any moment leaves
either the previous checkpoint or the new one, never half of one: a `.partial` folder or a
folder whose manifest does not match is reported and skipped.

The learning-rate schedule and the data order are functions of the step (prompts are drawn
from `seed` and the step index), so the step is their state.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from ..errors import TrilloraError
from ..models.layers import local
from .atomic import AtomicFolder, atomic_write_text, fsync_path

LATEST = "latest"


class CheckpointCorrupt(TrilloraError, ValueError):
    """A checkpoint folder that fails its manifest; the message names the file."""


@dataclass
class Found:
    """The newest complete checkpoint (or None) and what was passed over on the way."""

    path: Path | None
    skipped: list[str] = field(default_factory=list)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def partial_dir(root: Path, step: int) -> Path:
    return root / f".step-{step:06d}.partial"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def rank_tensors(params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's adapter, AdamW state and torch RNG, as flat safetensors names."""
    out = {f"param.{name}": local(p.detach()).cpu().contiguous() for name, p in params.items()}
    index = {id(p): name for name, p in params.items()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value):
                out[f"optim.{index[id(p)]}.{key}"] = local(value).cpu().contiguous().clone()
    out["rng.torch"] = torch.get_rng_state()
    return out


def restore_rank_tensors(
    tensors: dict[str, torch.Tensor],
    params: dict[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    where: Path,
    rng: bool = True,
) -> None:
    """Put a rank file's tensors back in place, bit for bit; a missing or misshapen one names itself.
    `rng`: the torch RNG too (a run's own checkpoint; another writer's RNG is not this process's)."""
    with torch.no_grad():
        for name, p in params.items():
            key = f"param.{name}"
            if key not in tensors:
                raise CheckpointCorrupt(
                    f"{where}: no tensor {key!r} (was the checkpoint written with other LoRA targets?)"
                )
            mine = local(p.data)
            if tuple(tensors[key].shape) != tuple(mine.shape):
                raise CheckpointCorrupt(
                    f"{where}: {key!r} has shape {tuple(tensors[key].shape)}, the model wants "
                    f"{tuple(mine.shape)} (another rank, layout or LoRA rank?)"
                )
            mine.copy_(tensors[key])
    states: dict[str, list[str]] = {}  # parameter name -> its optimizer state keys, in one pass over the file
    for k in tensors:
        if k.startswith("optim."):
            states.setdefault(k[len("optim.") :].rsplit(".", 1)[0], []).append(k)
    for name, p in params.items():
        for k in states.get(name, []):
            value, d = tensors[k].to(local(p.data).device), p.data
            if isinstance(d, DTensor) and value.dim():  # a sharded parameter keeps sharded state
                value = DTensor.from_local(
                    value, d.device_mesh, d.placements, run_check=False, shape=d.shape, stride=d.stride()
                )
            optimizer.state[p][k.rsplit(".", 1)[1]] = value
    if rng:
        torch.set_rng_state(tensors["rng.torch"])


def python_rng_state() -> dict:
    state = {"python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]]}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), pos, has_gauss, gauss]
    except ImportError:
        pass
    return state


def restore_python_rng(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def state_meta(config, steps: int, optimizer: torch.optim.Optimizer | None = None, **extra) -> dict:
    """A saved state's `state.json`: the LoRA settings of `config` (a `lora.LoraConfig`), the AdamW
    steps taken and its settings (`param_groups`), and what else its writer keeps (`extra`)."""
    meta = {"rank": config.rank, "roles": list(config.targets), "alpha": config.alpha, "seed": config.seed}
    meta |= {"expert_rank": config.expert_rank, "steps": steps, "time": time.time()}
    if optimizer is not None:
        meta["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return meta | extra


def write_state(folder: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """One saved state, whichever face writes it (a Tinker client's state or sampler weights, a
    learner's revision): `adapter.safetensors` (whole tensors) and `state.json` (`state_meta`),
    written atomically: a kill leaves the folder as it was or the new state, never half of one."""
    with AtomicFolder(folder) as tmp:
        save_file({k: t.contiguous().cpu() for k, t in tensors.items()}, str(tmp / "adapter.safetensors"))
        (tmp / "state.json").write_text(json.dumps(meta))


def write_rank_file(root: Path, step: int, rank: int, tensors: dict[str, torch.Tensor]) -> None:
    part = partial_dir(root, step)
    part.mkdir(parents=True, exist_ok=True)
    path = part / f"rank-{rank}.safetensors"
    save_file(tensors, str(path))
    fsync_path(path)


def commit(root: Path, step: int, state: dict, files: dict[str, str], keep: int) -> Path:
    """Rank 0, after every rank's file is written: the JSON files, the manifest, the rename,
    the `latest` pointer, then the oldest checkpoints beyond `keep`."""
    folder = AtomicFolder(step_dir(root, step), staging=partial_dir(root, step))
    part = folder.path
    for p in part.glob("rank-*.safetensors"):  # synced by their writers (every rank its own)
        folder.synced.add(p)
    (part / "state.json").write_text(json.dumps(state))
    for name, text in files.items():
        (part / name).write_text(text)
    paths = sorted(p for p in part.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(part)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in paths}
    (part / "manifest.json").write_text(json.dumps(manifest, indent=1))
    final = folder.commit()  # the same step written again (a resumed run that stopped at once) is replaced
    atomic_write_text(root / LATEST, final.name + "\n")
    for old in sorted(root.glob("step-*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def verify(path: Path) -> None:
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointCorrupt(f"{path}: no manifest.json")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointCorrupt(f"{manifest_path}: not JSON ({e.msg})") from None
    for name, entry in manifest.items():
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointCorrupt(f"{manifest_path}: names {name!r}, outside the checkpoint")
        f = path / name
        if not f.is_file():
            raise CheckpointCorrupt(f"{path}: {name} is missing")
        if f.stat().st_size != entry["bytes"] or _sha256(f) != entry["sha256"]:
            raise CheckpointCorrupt(f"{f}: does not match its manifest (truncated or changed)")


def find_latest(root: Path) -> Found:
    """The newest checkpoint that verifies, preferring what `latest` names; everything passed
    over (half-written `.partial` folders, folders failing their manifest) is listed."""
    found = Found(None)
    if not root.is_dir():
        return found
    found.skipped += [
        f"{p}: half-written (the run stopped while saving it)" for p in sorted(root.glob(".step-*.partial"))
    ]
    candidates = sorted(root.glob("step-*"), reverse=True)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
    for path in candidates:
        try:
            verify(path)
        except CheckpointCorrupt as e:
            found.skipped.append(str(e))
            continue
        found.path = path
        break
    return found


def load(path: Path, rank: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(state.json, this rank's tensors) of a verified checkpoint."""
    rank_file = path / f"rank-{rank}.safetensors"
    if not rank_file.is_file():
        raise CheckpointCorrupt(f"{path}: no {rank_file.name} (written by a run with fewer ranks?)")
    return json.loads((path / "state.json").read_text()), load_file(str(rank_file))


def clear_partials(root: Path) -> None:
    for p in root.glob(".step-*.partial"):
        shutil.rmtree(p, ignore_errors=True)


@dataclass
class AdapterState:
    """An adapter's saved state, whichever face wrote it: a `trillora train` checkpoint of one
    process, a Tinker client's saved state (`serve.tinker.states`) or a learner's revision. All hold the adapter and
    AdamW moments as `rank_tensors` names (`param.<module>.lora_X`, `optim.<module>.lora_X.<key>`)."""

    lora: dict
    """`lora.LoraConfig` fields: rank, alpha, targets, expert_rank, and a run's rslora, patterns, ..."""
    tensors: dict[str, torch.Tensor]
    optimizer_steps: int
    """AdamW steps taken (a Tinker client's optim_step calls; a run's steps × minibatches × epochs)."""
    run_step: int | None = None
    """A run checkpoint's step (None: a Tinker state)."""


def read_adapter_state(folder: Path, run: bool | None = None, tensors: bool = True) -> AdapterState:
    """The state in `folder`: a Tinker saved state (`adapter.safetensors`, `state.json`) or, `run`
    (None: whichever the folder holds), a checkpoint of a one-process run (`rank-0.safetensors`,
    `state.json`, `config.toml`, verified against its manifest); a checkpoint of a torchrun layout
    is refused by name (its tensors are per-rank shards). `tensors=False`: the settings alone, no
    tensor read. A state.json that is not one names the folder (`CheckpointCorrupt`)."""
    import tomllib

    folder = Path(folder)
    try:
        meta = json.loads((folder / "state.json").read_text())
        if run is None:  # a run's checkpoint has its config beside its rank files; a Tinker state neither
            run = (folder / "config.toml").is_file() and (folder / "rank-0.safetensors").is_file()
        if not run:
            lora = {"rank": meta["rank"], "targets": tuple(meta["roles"]), "expert_rank": meta.get("expert_rank")}
            lora.update({k: meta[k] for k in ("alpha", "seed") if k in meta})
            read = load_file(str(folder / "adapter.safetensors")) if tensors else {}
            return AdapterState(lora, read, int(meta.get("steps", 0)))
        if meta.get("layout", {"world": 1}) != {"world": 1}:
            raise CheckpointCorrupt(
                f"{folder} was written by a torchrun layout ({meta['layout']}): its tensors are per-rank "
                "shards; resume that run with the same layout, or use its exported adapter/"
            )
        lora = tomllib.loads((folder / "config.toml").read_text())["lora"]
        lora["targets"] = tuple(lora.get("targets", ()))
        if not tensors:
            return AdapterState(lora, {}, 0, int(meta["step"]))
        verify(folder)
        read = load_file(str(folder / "rank-0.safetensors"))
    except (OSError, KeyError, TypeError, ValueError) as e:  # JSON, TOML and safetensors errors are ValueErrors
        raise CheckpointCorrupt(f"{folder}: not a saved adapter state ({type(e).__name__}: {e})") from None
    steps = [int(t) for k, t in read.items() if k.startswith("optim.") and k.endswith(".step")]
    return AdapterState(lora, read, max(steps, default=0), int(meta["step"]))
