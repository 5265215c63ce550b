"""The Tinker-compatible service's records: what its routes hand the service (`FwdBwd`) and the
names it accepts (the registry keeps the sessions and training clients)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .wire import Datum

NAME = re.compile(
    r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}"
)  # fullmatch: never "." or "..", no newline; names become folders
MODEL_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._:-]{0,127}")


@dataclass
class FwdBwd:
    """One forward_backward (or forward) call, its data checked by `check_data`."""

    model_id: str
    loss_fn: str
    config: dict
    data: list[Datum]
    tensors: list[dict[str, torch.Tensor]]
    forward_only: bool
