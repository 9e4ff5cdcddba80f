"""Tiny transformers models built from configs (no downloads), twinned with transformers'
own attention on the same weights, for tests/test_transformers*.py.

Every model is fp32 with hidden size 64, 4 heads of 16 (2 K/V heads) and a vocabulary of
97; ``twins`` gives (reference, ours): the same weights, transformers' "eager" or "sdpa"
attention on the first, this package's backend (reference kernel) on the second.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.reference import tolerance

transformers = pytest.importorskip("transformers")
from schedules.integrations import transformers as sdpa_transformers  # noqa: E402

VOCAB = 97
IMAGE = 90  # the image token of the Gemma 3 model (its pixels become 4 such tokens)
TOL = tolerance(torch.float32)  # fp32 models, compared in the table's fp32 level


def config(cls=None, **changes):
    """A tiny config of ``cls`` (LlamaConfig by default): 2 layers unless changed."""
    cls = cls or transformers.LlamaConfig
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=64)
    fields.update(changes)
    return cls(**fields)


def gemma3_config(**changes):
    """A tiny Gemma 3 with a vision tower: a sliding layer (window 4) then a global one,
    images of 16 pixels as 4 tokens ``IMAGE``."""
    text = config(transformers.Gemma3TextConfig, sliding_window=4, sliding_window_pattern=2,
                  query_pre_attn_scalar=16, **changes)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=16, patch_size=4)
    return transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                     mm_tokens_per_image=4, image_token_id=IMAGE,
                                     boi_token_id=IMAGE - 2, eoi_token_id=IMAGE - 1)


def twins(model_cls, cfg, reference="eager", name=None):
    """(transformers' ``reference`` attention, this backend) on the same random weights."""
    name = name or sdpa_transformers.register(kernel="reference")
    torch.manual_seed(0)
    theirs = model_cls(copy.deepcopy(cfg)).eval()
    ours = model_cls(copy.deepcopy(cfg)).eval()
    ours.load_state_dict(theirs.state_dict())
    theirs.set_attn_implementation(reference)
    ours.set_attn_implementation(name)
    return theirs, ours


def ids(b=2, s=16, seed=1):
    return torch.randint(0, VOCAB - 8, (b, s), generator=torch.Generator().manual_seed(seed))


def assert_same(models, real=None, **inputs):
    """Logits (of the ``real`` tokens), loss and gradients of both models on ``inputs``
    (labels: the input ids unless given), within the fp32 tolerance."""
    inputs.setdefault("labels", inputs["input_ids"])
    results = []
    for model in models:
        model.zero_grad()
        out = model(**inputs, use_cache=False)
        out.loss.backward()
        results.append((out.logits.detach(), out.loss.detach(),
                        {n: p.grad.clone() for n, p in model.named_parameters()
                         if p.grad is not None}))
    (want_logits, want_loss, want_grads), (logits, loss, grads) = results
    real = torch.ones(logits.shape[:2], dtype=torch.bool) if real is None else real
    torch.testing.assert_close(logits[real], want_logits[real], **TOL)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert grads.keys() == want_grads.keys() and grads
    for name, want in want_grads.items():
        torch.testing.assert_close(grads[name], want, **TOL, msg=lambda m: f"{name}: {m}")


def assert_same_generation(models, prompt, **kwargs):
    """Greedy generation: the same tokens and, step by step, the same logits."""
    outs = [m.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0,
                       return_dict_in_generate=True, output_logits=True, **kwargs)
            for m in models]
    (want, got) = outs
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), **TOL)
