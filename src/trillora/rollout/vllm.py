"""`VLLMEngine`: vLLM's `LLM` in this process as the rollout engine.

Weight sync after each update is one of two kinds. `adapter`: the adapter is saved as a new
revision and sampled through a `LoRARequest` (bytes ∝ adapter size; the base never moves).
`merged`: base + scaling·B·A for the tensors the adapter changes, written into the running
engine (`vllm_sync`). `auto` picks adapter where vLLM can apply the adapter and merged
otherwise: vLLM on CPU runs no LoRA on MoE models at all (its MoE LoRA layer needs Triton GPU
kernels, even when only attention is adapted), so MoE on CPU syncs merged; dense models and
GPUs sync the adapter (router adapters have no vLLM form: merged).

vLLM reports the sampled token's logprob as `processed_logprobs` (after temperature, and
after top-k/top-p when those are set), the quantity the trainer recomputes for the
mismatch correction.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from ..lora.apply import lora_modules
from .types import Completion, SamplingParams
from .vllm_sync import load_merged, merged_tensors

SYNC_MODES = ("auto", "adapter", "merged")
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM's LoRA kernels are built for


def _cpu() -> bool:
    return not torch.cuda.is_available()


def choose_sync(model: nn.Module, mode: str = "auto") -> str:
    """The sync kind `auto` resolves to for this model on this machine."""
    if mode not in SYNC_MODES:
        raise ValueError(f"vLLM sync {mode!r}; allowed: {', '.join(SYNC_MODES)}")
    if mode != "auto":
        return mode
    roles = set(getattr(model, "lora_targets", {}).values())
    has_moe = bool(model.moe_layers()) if hasattr(model, "moe_layers") else False
    if "router" in roles or (has_moe and _cpu()):
        return "merged"
    return "adapter"


class VLLMEngine:
    def __init__(
        self,
        model_path: str | Path,
        model: nn.Module,
        sync: str = "auto",
        sync_dir: str | Path | None = None,
        dtype: str | None = None,
        max_model_len: int = 1024,
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        cpu_kv_cache_gib: int = 1,
        return_routing: bool = False,
        **llm_kwargs,
    ):
        from vllm import LLM

        self.sync_mode = choose_sync(model, sync)
        self.sync_dir = Path(sync_dir) if sync_dir is not None else Path(tempfile.mkdtemp(prefix="trillora-vllm-"))
        self.sync_dir.mkdir(parents=True, exist_ok=True)
        self.returns_routing = return_routing
        if _cpu():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib))
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: sync passes tensors directly
        kwargs = dict(
            model=str(model_path),
            dtype=dtype or ("float32" if _cpu() else "bfloat16"),
            max_model_len=max_model_len,
            seed=seed,
            enforce_eager=_cpu(),
            logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )
        if not _cpu():
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if return_routing:
            kwargs["enable_return_routed_experts"] = True
        if self.sync_mode == "adapter":
            ranks = [
                m.lora_A.shape[-2] if hasattr(m, "lora_A") else m.lora_gate_A.shape[-2] for _, m in lora_modules(model)
            ]
            need = max(ranks, default=1)
            rank = next((r for r in LORA_RANKS if r >= need), None)
            if rank is None:
                raise ValueError(
                    f"adapter rank {need} exceeds vLLM's largest LoRA rank {LORA_RANKS[-1]}; use sync='merged'"
                )
            kwargs.update(enable_lora=True, max_lora_rank=rank, max_loras=2)
        try:
            self.llm = LLM(**kwargs)
        except Exception as e:
            if return_routing:
                raise RuntimeError(
                    f"vLLM could not start with routed-expert return ({e}); vLLM returns routing only "
                    "with its V2 model runner (GPU, Triton). Use the local engine for router replay."
                ) from e
            raise
        self.revision = 0
        self.lora = None  # the LoRARequest in use (adapter sync)

    def pinned(self) -> None:
        return None  # one revision at a time: a sync replaces what generate uses

    # --- sync ----------------------------------------------------------------------------
    def sync(self, model: nn.Module) -> dict[str, float]:
        start = time.perf_counter()
        if self.sync_mode == "merged":
            tensors = merged_tensors(model)
            self.llm.collective_rpc(load_merged, args=(tensors,))
            self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
            sent = sum(t.numel() * t.element_size() for t in tensors.values())
            return {"sync_bytes": float(sent), "sync_seconds": time.perf_counter() - start}
        from vllm.lora.request import LoRARequest

        from ..lora import save_adapter
        from ..lora.export import vllm_layout

        self.revision += 1
        name = f"rev-{self.revision}"
        path = save_adapter(model, self.sync_dir / name, expert_layout=vllm_layout(model))
        previous, self.lora = self.lora, LoRARequest(name, self.revision, str(path.resolve()))
        self.llm.llm_engine.add_lora(self.lora)
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        sent = sum(f.stat().st_size for f in path.iterdir())
        return {"sync_bytes": float(sent), "sync_seconds": time.perf_counter() - start}

    # --- sampling ------------------------------------------------------------------------
    def _params(self, params: SamplingParams, n: int):
        from vllm import SamplingParams as VSamplingParams

        return VSamplingParams(
            n=n,
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            seed=params.seed,
            logprobs=0,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,
            skip_special_tokens=False,
            detokenize=False,
        )

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        """With a seed, n one-sample requests seeded seed + i·n + j (a seeded n>1 request gives
        every sample the same tokens in vLLM); without, one request of n per prompt."""
        from vllm.inputs import TokensPrompt

        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if params.return_routing and not self.returns_routing:
            raise ValueError("return_routing needs VLLMEngine(return_routing=True)")
        inputs, sampling = [], []
        for p, k, call in (r for requests in params.requests(prompts, n) for r in requests):
            inputs.append(TokensPrompt(prompt_token_ids=list(p)))
            sampling.append(self._params(call, k))
        outs = self.llm.generate(inputs, sampling, lora_request=self.lora, use_tqdm=False)
        flat: list[Completion] = []
        for out in outs:
            for o in out.outputs:
                tokens = list(o.token_ids)
                logprobs = [d[t].logprob for d, t in zip(o.logprobs, tokens, strict=True)]
                stopped = bool(tokens) and tokens[-1] in params.stop_token_ids
                routed = None
                if params.return_routing and o.routed_experts is not None:
                    fed = len(out.prompt_token_ids) + len(tokens) - 1  # the last sampled token is never fed
                    routed = torch.as_tensor(o.routed_experts, dtype=torch.long)[:fed]  # [T_in, L, K]
                flat.append(
                    Completion(
                        prompt_ids=list(out.prompt_token_ids),
                        token_ids=tokens,
                        logprobs=logprobs,
                        finish_reason="stop" if stopped else "length",
                        routed_experts=routed,
                    )
                )
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del llm
