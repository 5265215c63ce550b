"""What trillora knows about one model family, in one object: the rest of the package asks the
family of a model (`family_of(args)`), never its name.

A family is a folder, `models/<family>/`: `config.py` reads its Hugging Face `config.json`,
`build` makes the module (`transformer.build` for GQA/MLA layers over MoE or
SwiGLU; gpt-oss's `model.py` its own), and where its releases differ from our tensor layout a
`state_dict.py` converts (gpt-oss). `registry.py` holds one line per family.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .args import ModelArgs

if TYPE_CHECKING:
    from .transformer import CausalLM


class ReleaseLayout:
    """How a family's released checkpoints and PEFT adapters name and lay out tensors, against our
    modules. This base is the identity, right for every family whose release uses our names: experts
    per expert (`experts.{e}.gate_proj.weight`) or stacked [E, out, in] with gate rows before up rows,
    both of which the checkpoint code handles for every family."""

    expert_layouts: tuple[str, ...] = ("fused", "per_expert")
    """The expert layouts its checkpoints may be saved in."""
    vllm_expert_layout: str = "per_expert"
    """The adapter layout vLLM reads for this family."""
    quantized_experts: str | None = None
    """"mxfp4" where the release ships its routed experts quantised that way (sizes in `trillora info`)."""

    def from_release(
        self, name: str, tensor: torch.Tensor, pending: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A checkpoint tensor as (our name, our layout) pairs; a tensor that needs a partner stored in
        another entry (quantised blocks and their scales) waits in `pending` and yields nothing yet."""
        yield name, tensor

    def to_release(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """Our tensor under the release's name and layout (for `save_model`)."""
        return name, tensor

    def module_name(self, ours: str) -> str:
        """Our module name as the release's (adapter keys, vLLM's weight names)."""
        return ours

    def gate_up_to_release(self, rows: torch.Tensor, dim: int) -> torch.Tensor:
        """Rows of a stacked gate_up tensor (gate rows, then up rows, along `dim`) in the release's order."""
        return rows

    def gate_up_from_release(self, rows: torch.Tensor, dim: int) -> torch.Tensor:
        """The inverse of `gate_up_to_release`."""
        return rows


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    """`model_type` values of config.json this family reads (Kimi K2's `kimi_k2` is DeepSeek-V3's)."""
    architectures: dict[str, str]
    """`architectures` entry -> model_type, for a config.json without a model_type."""
    parse: Callable[[dict[str, Any], dict[str, Any], str], ModelArgs]
    """(config.json, the keys every family reads, where) -> ModelArgs."""
    build: Callable[[ModelArgs], CausalLM]
    release: ReleaseLayout = field(default_factory=ReleaseLayout)
