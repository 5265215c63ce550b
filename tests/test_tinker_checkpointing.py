"""`--activation-checkpoint-every` on the Tinker service: a call's gradients and logprobs are the
ones without it, and autograd keeps fewer activations for the backward (measured, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trillora.parallel import ParallelDims
from trillora.plan.memory_probe import MemoryProbe
from trillora.serve.config import ServeConfig
from trillora.serve.tinker.service import FwdBwd, TinkerService
from trillora.serve.tinker.wire import Datum

ROLES = ("attention", "mlp", "shared_experts", "experts", "lm_head")


def one_call(service: TinkerService) -> tuple[list, dict, int]:
    """A fresh client's forward_backward on two long datums: logprobs, gradients, saved bytes."""
    sid = service.create_session()
    model_id = service.create_model(sid, 1, 4, ROLES, 7)["model_id"]
    with torch.no_grad():
        for p in service.client(model_id).adapter.params.values():
            p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(hash(p.shape) % 1000))
    data = []
    for text in ("123+456=579 " * 8, "98+2=100 " * 10):
        ids = service.tokenizer.encode(text, add_special_tokens=False)
        data.append(Datum(ids[:-1], {"target_tokens": np.array(ids[1:]), "weights": np.ones(len(ids) - 1, np.float32)}))
    call = FwdBwd(model_id, "cross_entropy", {}, data, service.check_data("cross_entropy", {}, data), False)
    params = list(service.client(model_id).adapter.params.values())
    with MemoryProbe() as probe:
        probe.exclude([p for p in service.base.model.parameters()] + params)
        logprobs, _ = service.forward_backward_many([call])[0]
    grads = {k: p.grad.clone() for k, p in service.client(model_id).adapter.params.items()}
    return logprobs, grads, probe.report.saved_bytes


def test_checkpointed_layers_give_the_same_call_and_keep_less(tmp_path):
    plain = TinkerService(ServeConfig(model="tiny-moe-chat", state_dir=str(tmp_path / "a")))
    ckpt = TinkerService(
        ServeConfig(
            model="tiny-moe-chat", state_dir=str(tmp_path / "b"), parallel=ParallelDims(activation_checkpoint_every=1)
        )
    )
    lp_plain, g_plain, saved_plain = one_call(plain)
    lp_ckpt, g_ckpt, saved_ckpt = one_call(ckpt)
    for x, y in zip(lp_plain, lp_ckpt, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6)
    assert g_plain.keys() == g_ckpt.keys()
    for k in g_plain:
        torch.testing.assert_close(g_ckpt[k], g_plain[k], atol=1e-6, rtol=1e-5)
    assert saved_ckpt < 0.5 * saved_plain, (saved_ckpt, saved_plain)


def test_a_negative_interval_is_refused_by_name(tmp_path):
    with pytest.raises(Exception, match="activation_checkpoint_every=-1"):
        ServeConfig(model="tiny-moe-chat", parallel=ParallelDims(activation_checkpoint_every=-1))
