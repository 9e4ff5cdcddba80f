"""A transformers Llama training step under ``ring`` and ``head_parallel`` on GPUs, with the
fastest kernel (``auto``), against one-GPU training with transformers' SDPA attention, bf16.

    mpirun -np 2 python -m pytest -q tests/gpu_distributed/test_transformers_gpu.py

The Llama of examples/transformers_llama.py on GPUs (8 heads of 64, 4 K/V heads, 2 layers,
bf16), 4 rows of 1024 tokens: dense, padded (left and right) and packed (two documents per
row). One forward and backward: the loss, the logits of the real tokens and every weight's
gradient (after ``sum_gradients``) must match one GPU to bf16 accuracy. Skipped without GPUs
or without transformers.
"""

from __future__ import annotations

import pytest
import torch

import schedules

from .conftest import requires_gpus

pytestmark = requires_gpus
transformers = pytest.importorskip("transformers")
from examples.transformers_llama import make_batch, model_config  # noqa: E402
from schedules.integrations import transformers as sdpa_transformers  # noqa: E402

ROWS, LENGTH = 4, 1024
GRAD_ERROR = 0.05  # |g - g_one_gpu| / |g_one_gpu| per weight (bf16 through two layers)


def models(device):
    """(one-GPU model with transformers' SDPA, sdpa_fusion model), same bf16 weights."""
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(model_config(True)).to(device, torch.bfloat16)
    reference.set_attn_implementation("sdpa")
    model = transformers.LlamaForCausalLM(model_config(True)).to(device, torch.bfloat16)
    model.load_state_dict(reference.state_dict())
    model.set_attn_implementation(sdpa_transformers.register(kernel="auto"))
    return reference.train(), model.train()


def step(model, batch, sched=None):
    """(loss, logits, gradients) of one forward and backward: on the whole batch, or this
    rank's part under ``sched`` (loss and logits of the whole batch, summed gradients)."""
    if sched is None:
        out = model(**batch, use_cache=False)
        out.loss.backward()
        return out.loss.detach().float(), out.logits.detach().float(), _grads(model)
    sharded = sdpa_transformers.shard_batch(sched, **batch)
    out = model(**sharded.inputs)
    out.loss.backward()
    sharded.sum_gradients(model.parameters())
    return (sharded.total(out.loss).float(), sharded.unshard(out.logits.detach()).float(),
            _grads(model))


def _grads(model):
    return {name: p.grad.float() for name, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["dense", "padded", "packed"])
@pytest.mark.parametrize("name", ["ring", "head_parallel"])
def test_training_step_matches_one_gpu(mesh, name, kind):
    reference, model = models(mesh.device)
    batch = make_batch(kind, ROWS, LENGTH, reference.config.vocab_size, mesh.device)
    loss, logits, grads = step(model, batch, schedules.get(name, mesh))
    want_loss, want_logits, want_grads = step(reference, batch)
    torch.testing.assert_close(loss, want_loss, rtol=1e-2, atol=1e-2)
    real = batch["attention_mask"].bool() if "attention_mask" in batch else slice(None)
    torch.testing.assert_close(logits[real], want_logits[real], rtol=5e-2, atol=5e-2)
    for weight, want in want_grads.items():
        error = ((grads[weight] - want).norm() / want.norm().clamp(min=1e-6)).item()
        assert error < GRAD_ERROR, f"{name}, {kind}: gradient of {weight} off by {error:.3f}"


def test_attention_dropout_under_ring(mesh):
    """attention_dropout=0.1 on GPUs (a dropout kernel chosen by auto): the loss is finite,
    the same from the same seed, not the dropout-free one, and the gradients finite."""
    batch = make_batch("dense", ROWS, LENGTH, model_config(True).vocab_size, mesh.device)
    sched = schedules.get("ring", mesh)

    def loss(dropout):
        torch.manual_seed(0)
        config = model_config(True)
        config.attention_dropout = dropout
        model = transformers.LlamaForCausalLM(config).to(mesh.device, torch.bfloat16).train()
        model.set_attn_implementation(sdpa_transformers.register(kernel="auto"))
        torch.manual_seed(3)
        value, _, grads = step(model, batch, sched)
        assert all(bool(torch.isfinite(g).all()) for g in grads.values())
        return value

    first, again, plain = loss(0.1), loss(0.1), loss(0.0)
    assert bool(torch.isfinite(first)) and first == again and first != plain
