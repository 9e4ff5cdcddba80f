"""The transformers attention backend on one device against transformers' eager attention.

A tiny random Llama (hidden 64, 4 heads, 2 K/V heads, 2 layers, fp32): logits, loss and
gradients on dense, padded (left and right), packed (position_ids, or cu_seq_lens_q as
DataCollatorWithFlattening gives them) batches, greedy generation with a KV cache, and the
ValueErrors for what the backend cannot honour. Under schedules:
tests/distributed/test_transformers.py.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from schedules.integrations import transformers as sdpa_transformers  # noqa: E402

VOCAB, B, S = 97, 2, 16
TOL = dict(rtol=1e-5, atol=1e-5)


def config(cls=transformers.LlamaConfig, **changes):
    return cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               **changes)


@pytest.fixture(scope="module")
def models():
    """(eager model, sdpa_fusion model) with the same random weights."""
    name = sdpa_transformers.register(kernel="reference")
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(config()).eval()
    ours = transformers.LlamaForCausalLM(config()).eval()
    ours.load_state_dict(eager.state_dict())
    eager.set_attn_implementation("eager")
    ours.set_attn_implementation(name)
    return eager, ours


def ids_and_labels():
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    return ids, ids.clone()


def compare(models, real=None, **inputs):
    """Logits (of real tokens), loss and gradients of both models on ``inputs``."""
    results = []
    for model in models:
        model.zero_grad()
        out = model(**inputs, use_cache=False)
        out.loss.backward()
        results.append((out.logits.detach(), out.loss.detach(),
                        [p.grad.clone() for p in model.parameters()]))
    (logits, loss, grads), (want_logits, want_loss, want_grads) = results[1], results[0]
    real = torch.ones(logits.shape[:2], dtype=torch.bool) if real is None else real
    torch.testing.assert_close(logits[real], want_logits[real], **TOL)
    torch.testing.assert_close(loss, want_loss, **TOL)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, **TOL)


def test_dense_batch(models):
    ids, labels = ids_and_labels()
    compare(models, input_ids=ids, labels=labels)


def test_padded_batch(models):
    ids, labels = ids_and_labels()
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :3] = mask[1, 11:] = 0
    labels[mask == 0] = -100
    labels[0, 3] = -100  # the left padding's prediction of the first token is not wanted
    compare(models, mask.bool(), input_ids=ids, labels=labels, attention_mask=mask)


def test_packed_position_ids(models):
    ids, labels = ids_and_labels()
    positions = torch.tensor([[*range(5), *range(11)], [*range(7), *range(9)]])
    labels[positions == 0] = -100
    compare(models, input_ids=ids, labels=labels, position_ids=positions)


def test_packed_cu_seq_lens(models):
    """DataCollatorWithFlattening's flash kwargs: one row of documents 5, 4 and 7 long."""
    ids, labels = ids_and_labels()
    ids, labels = ids[:1], labels[:1]
    positions = torch.tensor([[*range(5), *range(4), *range(7)]])
    cu = torch.tensor([0, 5, 9, 16], dtype=torch.int32)
    eager, ours = models
    want = eager(input_ids=ids, position_ids=positions, use_cache=False).logits
    got = ours(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7,
               max_length_k=7, use_cache=False).logits  # no position_ids: cu_seq_lens decide
    torch.testing.assert_close(got, want, **TOL)  # RoPE at other positions: the same differences


def test_generation_with_a_kv_cache(models):
    """q a BSHE view, k and v the cache's contiguous tensors, one query over many keys."""
    ids, _ = ids_and_labels()
    eager, ours = models
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids[:1], **kwargs), eager.generate(ids[:1], **kwargs))


def test_what_cannot_be_honoured_is_a_value_error(models):
    ids, _ = ids_and_labels()
    _, ours = models
    mask4d = torch.ones(B, 1, S, S, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="takes a 2-D padding mask, got \\[2, 1, 16, 16\\]"):
        ours(input_ids=ids, attention_mask=mask4d, use_cache=False)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :2] = 0
    with pytest.raises(ValueError, match="does not take a padding mask with a KV cache"):
        ours.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                      pad_token_id=0)
    mistral = transformers.MistralForCausalLM(config(transformers.MistralConfig,
                                                     sliding_window=8))
    mistral.set_attn_implementation(sdpa_transformers.NAME)
    with pytest.raises(ValueError, match=r"does not take a sliding window \(sliding_window\)"):
        mistral(input_ids=ids, use_cache=False)
