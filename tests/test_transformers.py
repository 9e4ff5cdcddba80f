"""The transformers attention backend on one device against transformers' eager attention.

A tiny random Llama (hidden 64, 4 heads, 2 K/V heads, 2 layers, fp32): logits, loss and
gradients on dense, padded (left and right), packed (position_ids, or cu_seq_lens_q as
DataCollatorWithFlattening gives them) batches, greedy generation with a dynamic and a
static KV cache, a chunk after cached tokens, the names the backend registers under,
``shard_batch`` of the collator's batch, and the ValueErrors for what the backend cannot
honour. Masks, sliding windows and other model families: tests/test_transformers_masks.py;
under schedules: tests/distributed/test_transformers.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.reference import tolerance
from tests.transformers_models import assert_same, assert_same_generation, config, twins

transformers = pytest.importorskip("transformers")
from schedules.integrations import transformers as sdpa_transformers  # noqa: E402

VOCAB, B, S = 97, 2, 16
TOL = tolerance(torch.float32)  # fp32 models, compared in the table's fp32 level


@pytest.fixture(scope="module")
def models():
    """(eager model, sdpa_fusion model) with the same random weights."""
    return twins(transformers.LlamaForCausalLM, config())


def ids_and_labels():
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    return ids, ids.clone()


def test_dense_batch(models):
    ids, labels = ids_and_labels()
    assert_same(models, input_ids=ids, labels=labels)


def test_padded_batch(models):
    ids, labels = ids_and_labels()
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :3] = mask[1, 11:] = 0
    labels[mask == 0] = -100
    labels[0, 3] = -100  # the left padding's prediction of the first token is not wanted
    assert_same(models, mask.bool(), input_ids=ids, labels=labels, attention_mask=mask)


def test_packed_position_ids(models):
    ids, labels = ids_and_labels()
    positions = torch.tensor([[*range(5), *range(11)], [*range(7), *range(9)]])
    labels[positions == 0] = -100
    assert_same(models, input_ids=ids, labels=labels, position_ids=positions)


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


def test_generation_with_a_static_cache(models):
    """transformers' SDPA trims a static cache's empty slots; the backend does too (the
    prefill: 6 queries over 16 slots, nothing cached), then decodes over the slots filled."""
    prompt = ids_and_labels()[0][:1, :6]
    assert_same_generation(models, prompt, cache_implementation="static")
    assert_same_generation(models, prompt)  # the dynamic cache, for the record


def test_a_chunk_after_cached_tokens(models):
    """A second forward of 5 tokens after 11 cached ones: causal, aligned bottom-right."""
    ids, _ = ids_and_labels()
    logits = []
    for model in models:
        cache = transformers.DynamicCache(config=model.config)
        first = model(input_ids=ids[:, :11], cache=cache, use_cache=True).logits
        logits.append(torch.cat([first, model(input_ids=ids[:, 11:], cache=cache,
                                               use_cache=True).logits], 1))
    torch.testing.assert_close(logits[1], logits[0], **TOL)


def test_the_names():
    """"fusion_attention", and "sdpa_fusion" kept as an alias: both run a Llama; only the
    new name builds a model transformers does not let use SDPA (Gemma 2, whose own error
    about softcapping then shows)."""
    assert sdpa_transformers.register(kernel="reference") == sdpa_transformers.NAME \
        == "fusion_attention"
    assert sdpa_transformers.ALIASES == ("sdpa_fusion",)
    ids, _ = ids_and_labels()
    for name in (sdpa_transformers.NAME, *sdpa_transformers.ALIASES):
        assert_same(twins(transformers.LlamaForCausalLM, config(), name=name), input_ids=ids)
    gemma2 = config(transformers.Gemma2Config, attn_logit_softcapping=None, sliding_window=4)
    assert_same(twins(transformers.Gemma2ForCausalLM, gemma2), input_ids=ids)
    with pytest.raises(ValueError, match="does not support an attention implementation through "
                                         "torch.nn.functional.scaled_dot_product_attention"):
        twins(transformers.Gemma2ForCausalLM, gemma2, name="sdpa_fusion")
    softcapped = twins(transformers.Gemma2ForCausalLM, config(transformers.Gemma2Config))[1]
    with pytest.raises(ValueError, match=r"does not take softcapping of the scores \(softcap\)"):
        softcapped(input_ids=ids, use_cache=False)


def collated(position_ids=True, seq_idx=False):
    """DataCollatorWithFlattening's batch (flash kwargs) of documents 5, 4 and 7 long."""
    docs = ids_and_labels()[0].flatten()[:16].split([5, 4, 7])
    collator = transformers.DataCollatorWithFlattening(
        return_flash_attn_kwargs=True, return_position_ids=position_ids, return_seq_idx=seq_idx)
    return collator([{"input_ids": d.tolist()} for d in docs], return_tensors="pt")


def test_shard_batch_takes_the_collators_batch(models):
    """shard_batch(None, **collated) (one device) equals the model on the collated batch,
    which equals transformers' eager attention on the packed position_ids."""
    eager, ours = models
    batch = collated(seq_idx=True)
    assert {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"} <= \
        set(batch)
    sharded = sdpa_transformers.shard_batch(None, **batch)
    want = eager(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                 labels=batch["labels"], use_cache=False)
    for inputs in (sharded.inputs, {**batch, "use_cache": False}):
        out = ours(**inputs)
        torch.testing.assert_close(sharded.unshard(out.logits) if inputs is sharded.inputs
                                   else out.logits, want.logits, **TOL)
        torch.testing.assert_close(sharded.total(out.loss) if inputs is sharded.inputs
                                   else out.loss, want.loss, **TOL)


def test_shard_batch_checks_the_collators_keys():
    batch = collated(seq_idx=True)
    shard = sdpa_transformers.shard_batch
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k must both be given"):
        shard(None, **{**batch, "cu_seq_lens_k": torch.tensor([0, 9, 16], dtype=torch.int32)})
    with pytest.raises(ValueError, match=r"max_length_q=6 is shorter than the longest document "
                                         r"\(7 tokens\)"):
        shard(None, **{**batch, "max_length_q": 6})
    with pytest.raises(ValueError, match="seq_idx does not number the documents"):
        shard(None, **{**batch, "seq_idx": torch.zeros_like(batch["seq_idx"])})
    with pytest.raises(ValueError, match="either attention_mask .* or cu_seq_lens_q/k"):
        shard(None, **batch, attention_mask=torch.ones_like(batch["input_ids"]))
    with pytest.raises(ValueError, match=r"\[0, 5, 9, 16\] must rise from 0 to the 12 tokens "
                                         r"of the one packed row"):
        shard(None, **{**batch, "input_ids": batch["input_ids"][:, :12],
                       "labels": batch["labels"][:, :12], "position_ids": None,
                       "seq_idx": None})


def test_what_cannot_be_honoured_is_a_value_error(models):
    ids, _ = ids_and_labels()
    _, ours = models
    blocks = torch.ones(B, 1, S, S, dtype=torch.bool).tril()
    blocks[..., 8:, :8] = False  # two documents as a block-diagonal 4-D mask
    with pytest.raises(ValueError, match="cannot run this 4-D attention_mask: a 4-D mask that "
                                         "is not causal or bidirectional"):
        ours(input_ids=ids, attention_mask=blocks, use_cache=False)
    bias = torch.zeros(B, 1, S, S).masked_fill(~blocks, float("-inf")) + 0.5
    with pytest.raises(ValueError, match="an additive bias"):
        ours(input_ids=ids, attention_mask=bias, use_cache=False)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :2] = 0
    with pytest.raises(ValueError, match="does not take a padding mask with a KV cache"):
        ours.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                      pad_token_id=0)
