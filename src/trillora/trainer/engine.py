"""The rollout engine a run samples with, built from its `rollout` section."""

from __future__ import annotations

from torch import nn

from ..checkpoint import resolve_model_path
from ..errors import ConfigError
from ..policy.world import launched
from ..rollout import LocalEngine, OpenAIEngine, RolloutEngine


def check_engine(cfg) -> None:
    """What no engine of this kind can do in this launch, refused before anything starts."""
    if launched() and cfg.rollout.engine == "vllm":
        raise ConfigError(
            "rollout.engine='vllm' runs vLLM inside this process, which torchrun already made a "
            "distributed rank; under torchrun serve vLLM and use rollout.engine='openai'"
        )
    if launched() and cfg.rollout.engine == "local" and cfg.rollout.precision not in ("auto", "policy"):
        raise ConfigError(
            f"rollout.precision={cfg.rollout.precision!r} merges the adapter into a whole copy of the base "
            "on rank 0; under torchrun the local engine samples with the sharded policy itself: use "
            "rollout.precision='policy' (what 'auto' means there), or serve vLLM and use rollout.engine='openai'"
        )
    if launched() and cfg.rollout.asynchronous:
        raise ConfigError("rollout.asynchronous needs one process (not torchrun)")


def make_engine(cfg, model: nn.Module, device, pad_id: int, routing: bool) -> RolloutEngine:
    """`model`: the unsharded policy the engine copies (merged) or syncs adapters from."""
    r = cfg.rollout
    sync_dir = r.sync_dir or cfg.run_dir / "sync"
    if r.engine == "openai":
        # with asynchronous rollouts a batch may still sample from the revisions of the last K updates
        keep = r.max_staleness + 1 if r.asynchronous else 1
        return OpenAIEngine(
            list(r.urls),
            model=r.server_model or cfg.model.path,
            api_key=r.api_key or None,
            sync_dir=sync_dir,
            sync="adapter" if r.sync == "auto" else r.sync,
            keep_revisions=keep,
        )
    if r.engine == "vllm":
        from ..rollout.vllm import VLLMEngine

        dtype = {"auto": None, "fp32": "float32", "bf16": "bfloat16"}[r.precision]
        return VLLMEngine(
            resolve_model_path(cfg.model.path),
            model,
            sync=r.sync,
            sync_dir=sync_dir,
            dtype=dtype,
            max_model_len=r.max_model_len,
            seed=cfg.seed,
            return_routing=routing,
        )
    return LocalEngine(model, precision="policy" if launched() else r.precision, device=device, pad_id=pad_id)
