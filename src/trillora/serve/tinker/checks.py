"""Checks of Tinker requests before they reach the worker (a sample call's are `calls.check_sample`,
every face's): a bad datum or sampling setting is
refused with a message naming the datum, key and allowed values, and never half-applied.
Also the service's records: what its routes hand it (`FwdBwd`) and the names it accepts.
Shape legend: N one datum's tokens, K top-k targets."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...rl.tinker_losses import LossInputError, check_loss
from ..calls import BadRequest
from .wire import Datum, WireError, dense_from_csr

# fullmatch: never "." or "..", no newline; names become folders
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
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


def check_data(
    loss_fn: str, config: dict, data: list[Datum], vocab: int, positions: int
) -> list[dict[str, torch.Tensor]]:
    """Each datum's `loss_fn_inputs` as tensors, checked against its tokens and the loss; each datum
    within the model's `positions`."""
    if not data:
        raise BadRequest("forward_backward needs at least one datum")
    for i, d in enumerate(data):
        if len(d.tokens) > positions:
            raise BadRequest(f"datum {i}: {len(d.tokens)} tokens; the model has {positions} positions")
    try:
        check_loss(loss_fn, set.intersection(*(set(d.inputs) for d in data)), config)
    except LossInputError as e:
        raise BadRequest(str(e)) from None
    return [_datum_tensors(i, d, loss_fn, vocab) for i, d in enumerate(data)]


def _datum_tensors(i: int, d: Datum, loss_fn: str, vocab: int) -> dict[str, torch.Tensor]:
    n = len(d.tokens)
    if n == 0:
        raise BadRequest(f"datum {i}: model_input has no tokens")
    if max(d.tokens) >= vocab or min(d.tokens) < 0:
        raise BadRequest(f"datum {i}: model_input token ids must be in 0..{vocab - 1}")
    tensors = {}
    for key, value in d.inputs.items():
        if value.ndim == 0 or value.shape[0] != n:
            raise BadRequest(
                f"datum {i}: loss_fn_inputs[{key!r}] has shape {list(value.shape)}, "
                f"want {n} rows (one per model_input token)"
            )
        tensors[key] = torch.from_numpy(np.array(value))
    targets = tensors["target_tokens"]  # [N] or [N, K]
    if targets.ndim > 2 or (targets.ndim == 2 and loss_fn != "cross_entropy"):
        raise BadRequest(f"datum {i}: target_tokens of shape {list(targets.shape)}; [N] (or [N, K] for cross_entropy)")
    if int(targets.min()) < 0 or int(targets.max()) >= vocab:
        raise BadRequest(f"datum {i}: target_tokens must be in 0..{vocab - 1}")
    for key, t in tensors.items():
        if key != "target_tokens" and t.shape != targets.shape and not (t.ndim == 1 and targets.ndim == 1):
            raise BadRequest(
                f"datum {i}: loss_fn_inputs[{key!r}] has shape {list(t.shape)}, target_tokens {list(targets.shape)}"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise BadRequest(f"datum {i}: loss_fn_inputs[{key!r}] holds NaN or infinity")
    if loss_fn == "gspo" and not bool((tensors["sequence_ratio_mask"] != 0).any()):
        raise BadRequest(f"datum {i}: sequence_ratio_mask marks no token (gspo's sequence ratio is a mean over them)")
    return tensors


MAX_TOPK = 64


def sample_options(b: dict, prompt_len: int, vocab: int) -> dict:
    """An asample request's scoring options, checked: `topk_prompt_logprobs`, `topk_sample_logprobs`,
    `prompt_alt_tokens_k` (each 0..64), `prompt_logprobs_last_n` (1..N-1, with prompt logprobs),
    `target_prompt_logprobs` (ids [N-1, K] as Tinker's TensorData, dense or CSR; -1 asks nothing)."""
    out: dict = {}
    for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        k = b.get(key) or 0
        if type(k) is not int or not 0 <= k <= min(MAX_TOPK, vocab):
            raise BadRequest(f"{key}={k!r}; allowed: an integer in 0..{min(MAX_TOPK, vocab)}")
        if k:
            out[key] = k
    last_n = b.get("prompt_logprobs_last_n")
    if last_n is not None:
        if not b.get("prompt_logprobs"):
            raise BadRequest("prompt_logprobs_last_n needs prompt_logprobs=true")
        if type(last_n) is not int or not 1 <= last_n <= prompt_len - 1:
            raise BadRequest(
                f"prompt_logprobs_last_n={last_n!r}; allowed: an integer in 1..{prompt_len - 1} (the prompt's length "
                f"- 1)"
            )
        out["prompt_logprobs_last_n"] = last_n
    if b.get("target_prompt_logprobs") is not None:
        out["target_prompt_logprobs"] = _targets(b["target_prompt_logprobs"], prompt_len, vocab)
    return out


def _targets(t, prompt_len: int, vocab: int) -> np.ndarray:
    """Tinker's TensorData of token ids, [N-1, K], as a dense int64 array with -1 where nothing is asked."""
    where = "target_prompt_logprobs"
    if not isinstance(t, dict) or not isinstance(t.get("data"), list) or not isinstance(t.get("shape"), list):
        raise BadRequest(f"{where}: a TensorData object with data and shape")
    shape = t["shape"]
    if len(shape) != 2 or shape[0] != prompt_len - 1 or type(shape[1]) is not int or not 1 <= shape[1] <= MAX_TOPK:
        raise BadRequest(
            f"{where}: shape {shape!r}; want [{prompt_len - 1}, K] with K in 1..{MAX_TOPK} (one row per "
            "prompt position after the first)"
        )
    if not all(type(x) is int for x in t["data"]):
        raise BadRequest(f"{where}: token ids must be integers")
    data = np.array(t["data"], dtype=np.int64)
    crow, col = t.get("sparse_crow_indices"), t.get("sparse_col_indices")
    if crow is None:
        if data.size != shape[0] * shape[1]:
            raise BadRequest(f"{where}: {data.size} values for shape {shape}")
        dense = data.reshape(shape)
    else:
        try:
            dense = dense_from_csr(
                shape,
                data,
                np.array(crow, dtype=np.int64),
                np.array(col if col is not None else [], dtype=np.int64),
                -1,
                where,
            )
        except WireError as e:
            raise BadRequest(str(e)) from None
    if ((dense < -1) | (dense >= vocab)).any():
        raise BadRequest(f"{where}: token ids must be -1 (nothing) or in 0..{vocab - 1}")
    return dense


ADAM_DEFAULTS = dict(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)


def adam_settings(adam: dict) -> tuple[float, float, float, float, float, float]:
    """(lr, beta1, beta2, eps, weight_decay, grad_clip_norm) with the SDK's defaults, or BadRequest."""
    settings = {k: adam.get(k, default) for k, default in ADAM_DEFAULTS.items()}
    for key, v in settings.items():
        number = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
        if not number or not 0 <= v < (1 if key.startswith("beta") else math.inf):
            raise BadRequest(f"adam_params.{key}={v!r} is out of range")
    return tuple(settings.values())


def state_path(root: Path, model_id: str, kind: str, name: str) -> tuple[str, Path]:
    """The tinker:// path and the folder under `root` of a saved state, or BadRequest: names that
    could leave the folder (and symlinks planted under it) are refused."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise BadRequest(f"checkpoint name {name!r}: use 1-128 letters, digits, '.', '_' or '-', not starting with '.'")
    if not MODEL_ID.fullmatch(model_id):
        raise BadRequest(f"model id {model_id!r} in a tinker:// path is not one this server writes")
    folder = root / model_id.replace(":", "_") / kind / name
    if root.resolve() not in folder.resolve().parents:  # a symlink planted under the state folder
        raise BadRequest(f"tinker://{model_id}/{kind}/{name} leads outside the server's state folder", 403)
    return f"tinker://{model_id}/{kind}/{name}", folder


RUN_CHECKPOINT = re.compile(r"tinker://runs/([^/]+)/checkpoints/(step-[0-9]{6})")
"""A `trillora train` checkpoint of a run written under the state folder (`out_dir=<state_dir>/runs`)."""


def resolve(root: Path, tinker_path: str) -> tuple[str, str, Path]:
    """(model id, kind, folder) of an existing saved state's tinker:// path: a client's weights or
    sampler weights, or (kind "checkpoint") a run's checkpoint under `<root>/runs/`."""
    if (run := RUN_CHECKPOINT.fullmatch(tinker_path or "")) is not None:
        if not NAME.fullmatch(run.group(1)):
            raise BadRequest(f"run name {run.group(1)!r} in {tinker_path!r}: use letters, digits, '.', '_' or '-'")
        folder = root / "runs" / run.group(1) / "checkpoints" / run.group(2)
        files = [folder / "rank-0.safetensors", folder / "state.json", folder / "config.toml"]
        kind = "checkpoint"
    else:
        m = re.fullmatch(r"tinker://([^/]+)/(weights|sampler_weights)/([^/]+)", tinker_path or "")
        if m is None:
            raise BadRequest(
                f"path {tinker_path!r} is not tinker://<model_id>/weights|sampler_weights/<name> "
                "nor tinker://runs/<run>/checkpoints/step-<NNNNNN>"
            )
        _, folder = state_path(root, m.group(1), m.group(2), m.group(3))
        files, kind = [folder / "adapter.safetensors", folder / "state.json"], m.group(2)
    if root.resolve() not in folder.resolve().parents:  # a symlink planted under the state folder
        raise BadRequest(f"{tinker_path!r} leads outside the server's state folder", 403)
    if any(f.is_symlink() for f in files):  # planted: it would read a file from outside the state folder
        raise BadRequest(f"{tinker_path!r} holds a link, not a saved state", 403)
    if not all(f.is_file() for f in files):
        raise BadRequest(f"no saved weights at {tinker_path!r}", 404)
    return (run.group(1) if run else m.group(1)), kind, folder
