"""Hugging Face checkpoint folders in and out: config.json, (sharded) safetensors, tokenizer files.

Loading builds the model on the meta device, allocates it once, and streams
tensors shard by shard into the allocated parameters (`checkpoint.weights`), so a checkpoint never
lives twice in memory. With `experts=(rank, size)` a rank allocates and reads only its slice
of the routed experts (expert parallelism's), with `layers` only its pipeline stage; a caller
that splits the model further (tensor parallelism) does so between `meta_model` and `fill_model`.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Literal, get_args

import torch
from safetensors.torch import save_file
from torch import nn

from ..errors import MissingPath
from ..models import CausalLM, ModelArgs, build_model, load_hf_config, release_of
from ..models.transformer import OtherStage, keep_stage
from .atomic import AtomicFolder
from .weights import INDEX, CheckpointError, load_weights, shard_files  # noqa: F401  (re-exported)

ExpertLayout = Literal["per_expert", "fused"]
"""Stacked experts on disk: one tensor per expert and projection as released (vLLM's adapter names
too), or fused `gate_up_proj` / `down_proj` as transformers 5 (and PEFT's `target_parameters`) hold them."""
EXPERT_LAYOUTS: tuple[str, ...] = get_args(ExpertLayout)
SHIPPED_CHECKPOINTS = ("tiny-moe", "tiny-moe-chat")
"""Checkpoints inside the package, loadable by name (no download)."""


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}(@[\w./-]{1,128})?")
"""`org/name`, or `org/name@revision` (a branch, tag or commit) to pin one."""
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]
"""What a Hub download fetches: config, weights, tokenizer (and a tokenizer's own code, run only
with trust_remote_code); not .bin/.pth copies or `original/` consolidated checkpoints."""


def resolve_model_path(path: str | Path) -> Path:
    """The folder of a model named as users of transformers, vLLM and PEFT name one: a checkpoint
    folder; a model shipped with trillora (`tiny-moe`, `tiny-moe-chat`); or a Hugging Face Hub id
    (`Qwen/Qwen3-30B-A3B`, `org/name@revision` to pin one), found in the Hub cache or downloaded
    into it by `huggingface_hub` (`HF_HOME`, `HF_HUB_CACHE` and `HF_HUB_OFFLINE=1` honoured)."""
    name = str(path)
    if name in SHIPPED_CHECKPOINTS:
        return Path(str(resources.files("trillora").joinpath(f"assets/{name}")))
    if Path(path).exists():
        return Path(path)
    if not HUB_ID.fullmatch(name):
        close = difflib.get_close_matches(name, SHIPPED_CHECKPOINTS, n=1)
        hint = f": did you mean {close[0]}?" if close else f" (shipped: {', '.join(SHIPPED_CHECKPOINTS)})"
        raise MissingPath(
            f"{name!r} is not a folder, not a Hugging Face Hub id (org/name) and not a shipped model{hint}"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, _, revision = name.partition("@")
    try:
        return Path(snapshot_download(repo, revision=revision or None, allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError as e:
        raise MissingPath(
            f"{name!r} is not a folder here, and the Hub id is not in the Hugging Face cache "
            f"({_hub_cache()}) and could not be downloaded ({type(e).__name__}). Download it first "
            f"(`hf download {repo}`), point HF_HUB_CACHE at a cache that holds it, or give a folder"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise MissingPath(
            f"{name!r}: not a folder here, and the Hub could not give it: {type(e).__name__}: {e}"
        ) from None


def _hub_cache() -> str:
    from huggingface_hub import constants

    offline = " with HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else ""
    return f"{constants.HF_HUB_CACHE}{offline}"


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    experts: tuple[int, int] | None = None,
    layers: range | None = None,
) -> CausalLM:
    """A model from a Hugging Face folder (config.json + safetensors), weights in `dtype` on `device`;
    `tiny-moe` loads the shipped one. `experts=(rank, size)`: only routed experts
    [rank·E/size, (rank+1)·E/size) are allocated and read, as `parallel.expert_parallel` keeps them.
    `layers`: only a pipeline stage's decoder layers (and the embedding or the head if the stage
    begins or ends the model) are allocated and read; the rest are `OtherStage` placeholders."""
    return fill_model(meta_model(path, dtype, experts, layers), path, device, experts)


def meta_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    experts: tuple[int, int] | None = None,
    layers: range | None = None,
) -> CausalLM:
    """The checkpoint's model on the meta device (nothing allocated), cut as `load_model` cuts it:
    for a caller that splits it further (tensor parallelism) before `fill_model` allocates and
    reads this rank's parts."""
    from ..models.moe import GroupedExperts, shard_experts

    path = resolve_model_path(path)
    if not path.is_dir():
        raise MissingPath(f"{path}: not a checkpoint folder")
    args, _ = load_hf_config(path)
    model = build_model(args, device="meta", dtype=dtype)
    if experts is not None:
        if not args.num_experts or args.num_experts % experts[1] or not 0 <= experts[0] < experts[1]:
            raise CheckpointError(
                f"{path}: cannot keep experts slice {experts[0]} of {experts[1]} (num_experts={args.num_experts})"
            )
        for m in model.modules():
            if isinstance(m, GroupedExperts):
                shard_experts(m, *experts)  # on meta: nothing allocated yet
    if layers is not None:
        if not (0 <= layers.start < layers.stop <= args.num_layers):
            raise CheckpointError(f"{path}: cannot keep layers {layers.start}..{layers.stop - 1} of {args.num_layers}")
        keep_stage(model, layers)
    return model


def fill_model(
    model: nn.Module, path: str | Path, device: str | torch.device = "cpu", experts: tuple[int, int] | None = None
) -> nn.Module:
    """Allocate `model` (from `meta_model`, maybe split since) on `device` and read its weights; a
    tensor-parallel DTensor reads its own part of each checkpoint tensor."""
    path = resolve_model_path(path)
    model.to_empty(device=device)
    whole = not isinstance(model.lm_head, OtherStage) and not isinstance(model.model.embed_tokens, OtherStage)
    if model.args.tie_word_embeddings and whole:
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
    release = release_of(model.args)
    if expert_layout not in release.expert_layouts:
        raise CheckpointError(
            f"{model.args.family} checkpoints have one expert layout (as released and as transformers "
            f"loads them); use expert_layout={release.expert_layouts[0]!r}"
        )
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if model.args.tie_word_embeddings and name == "lm_head.weight":
            continue
        name, t = release.to_release(name, t.detach())
        out.update(expert_tensors_per_expert(name, t) if expert_layout == "per_expert" else [(name, t.contiguous())])
    return out


def save_model(
    model: CausalLM,
    path: str | Path,
    expert_layout: str = "fused",
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 2 * 1024**3,
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
            (tmp / INDEX).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        config = _config_for_save(model.args, dtype or next(iter(tensors.values())).dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return path


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
        raise CheckpointError(
            f"{config}: the tokenizer is code ({module}.py, auto_map.AutoTokenizer); read it, then "
            "allow it with model.trust_remote_code=true (train) or --trust-remote-code (serve, eval, generate)"
        )
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=bool(code) and trust_remote_code)


def check_tokenizer_fits(tokenizer, vocab_size: int, path: str | Path) -> None:
    """A tokenizer with ids past the model's embedding rows belongs to another model: say so at
    load, not as an IndexError in the first forward. (Fewer ids than rows is normal: padding.)"""
    if len(tokenizer) > vocab_size:
        raise CheckpointError(
            f"{path}: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{vocab_size} (config.json): they are not one model's"
        )
