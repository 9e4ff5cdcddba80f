"""The masks transformers builds, as the backend reads them, and the model families they come
from, against transformers' own attention on the same weights (tiny models from configs).

- ``read`` of transformers' mask functions, a table: causal, sliding windows (a window of w
  keeps q - kv <= w - 1: the w most recent keys, the query's own included), bidirectional,
  packed documents, image blocks and chunks that change nothing, and what is refused.
- Sliding windows through ``window=``: Mistral (its default window of 4096 on 12 tokens, a
  window of 4 on 16), Qwen2 with windowed layers, Gemma 2 and Gemma 3 text models (sliding
  and global layers mixed); dense, padded, packed batches, gradient checkpointing, greedy
  generation with dynamic and static (sliding) caches: logits, loss and gradients against
  "eager" (and "sdpa" where eager misreads a bool mask).
- Overlays run exactly (``exact``): transformers' own boolean masks against the composed
  mask's (Gemma 3's image blocks on global and sliding layers, PaliGemma's prompt as a
  prefix, Llama 4's chunks with left padding); a Gemma 3 with images and a Llama 4 with
  chunks of 8 on 16 tokens against eager (logits at the image positions, gradients).
- ValueErrors naming what the backend cannot run: a model's own mask function, image blocks
  inside packed documents' remapped positions, overlays with a KV cache, a mask that
  disagrees with its layer.
"""

from __future__ import annotations

import pytest
import torch

from tests.transformers_models import (IMAGE, TOL, assert_same, assert_same_generation, config,
                                       gemma3_config, ids, twins)

transformers = pytest.importorskip("transformers")
from transformers import masking_utils as mu  # noqa: E402

import schedules.batch  # noqa: E402
from schedules.integrations.transformers import _sequences, _top_left  # noqa: E402
from schedules.integrations.transformers_masks import (Band, Call, Sequences,  # noqa: E402
                                                       Unsupported, exact, read, read_dense)

S = 16
CALL = Call(q_len=S, kv_len=S)


def padded_mask():
    """Row 0 left-padded by 3, row 1 right-padded by 5."""
    mask = torch.ones(2, S, dtype=torch.long)
    mask[0, :3] = mask[1, 11:] = 0
    return mask


def padded_labels(mask):
    """The input ids, -100 where a padding token is or predicts (its logits are padding's)."""
    labels = ids(s=S).masked_fill(mask == 0, -100)
    labels[:, 1:][mask[:, :-1] == 0] = -100
    return labels


PACKED = torch.tensor([[*range(5), *range(11)], [*range(7), *range(9)]])


def packed(fn):
    """``fn`` as transformers wraps it for the packed documents of PACKED."""
    return mu.and_masks(mu.remap_positions_for_packed_sequence(fn, PACKED),
                        mu.packed_sequence_mask_function(mu.find_packed_sequence_indices(PACKED)))


def blocks(*spans, width=S):
    """block_sequence_ids of one row: image blocks over ``spans`` [start, stop)."""
    ids_ = torch.full((1, width), -1)
    for group, (start, stop) in enumerate(spans):
        ids_[0, start:stop] = group
    return ids_


# ---- reading transformers' mask functions ---------------------------------------------------
BANDS = {
    "causal": (mu.causal_mask_function, CALL, Band(0, None)),
    "sliding window of 4": (mu.sliding_window_causal_mask_function(4), CALL, Band(0, 3)),
    "bidirectional": (mu.bidirectional_mask_function, CALL, Band(None, None)),
    "bidirectional window of 2": (mu.sliding_window_bidirectional_mask_function(2), CALL,
                                  Band(-2, 2)),
    "packed causal": (packed(mu.causal_mask_function), CALL, Band(0, None, True, True)),
    "packed sliding": (packed(mu.sliding_window_causal_mask_function(4)), CALL,
                       Band(0, 3, True, True)),
    "text only (no image block)": (mu.or_masks(mu.causal_mask_function,
                                               mu.blockwise_overlay(blocks())), CALL,
                                   Band(0, None)),
    "one-token image blocks": (mu.or_masks(mu.causal_mask_function,
                                           mu.blockwise_overlay(blocks((2, 3), (7, 8)))), CALL,
                               Band(0, None)),
    "an image before the decoded query": (
        mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(blocks((2, 6), width=S + 1))),
        Call(q_len=1, kv_len=S + 1, q_offset=S), Band(0, None)),
    "Gemma 3 vision sliding, text only": (
        mu.and_masks(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(blocks())),
                     mu.sliding_window_overlay(4)), CALL, Band(0, 3)),
    "chunks longer than the sequence": (
        mu.chunked_causal_mask_function(32, torch.zeros(2, dtype=torch.long)), CALL,
        Band(0, None)),
}


@pytest.mark.parametrize("what", list(BANDS))
def test_read_gives_the_band(what):
    fn, call, want = BANDS[what]
    reading = read(fn, call)
    assert reading.band == want and not reading.matter


def test_the_band_is_the_mask_transformers_makes():
    """A sliding window of w keeps q - kv in [0, w - 1], as transformers' sdpa_mask."""
    for w in (1, 3, 4, 16):
        band = read(mu.sliding_window_causal_mask_function(w), CALL).band
        made = mu.sdpa_mask(1, S, S, mask_function=mu.sliding_window_causal_mask_function(w),
                            allow_is_causal_skip=False)[0, 0]
        d = torch.arange(S)[:, None] - torch.arange(S)[None]
        assert torch.equal(made, (d >= band.lo) & (d <= band.hi)), w


def custom(batch_idx, head_idx, q_idx, kv_idx):
    return q_idx < 4  # a prefix of 4 tokens seen by all


REFUSED = {
    "a custom or_mask_function": (mu.or_masks(mu.causal_mask_function, custom), CALL,
                                  r"a custom mask function \(tests\.test_transformers_masks\."
                                  r"custom\)"),
    "documents by sequence ids only": (
        mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(PACKED)), CALL,
        "documents given by sequence ids"),
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_read_names_what_is_not_a_band(what):
    fn, call, message = REFUSED[what]
    with pytest.raises(Unsupported, match=message):
        read(fn, call)


def test_bands_meet_and_join():
    assert Band(0, None) & Band(None, 3) == Band(0, 3)
    assert Band(-2, 2) | Band(0, 5) == Band(-2, 5)
    assert Band(0, 1) | Band(2, None) == Band(0, None)  # adjacent
    with pytest.raises(Unsupported, match="a union of two disjoint bands"):
        Band(0, 1) | Band(5, None)


# ---- overlays: the exact mask --------------------------------------------------------------
IMAGES = torch.cat([blocks((3, 7)), blocks((1, 5), (9, 14))])  # two rows of image blocks
PROMPT = torch.where(torch.arange(S) < 6, 0, -1).expand(2, S)  # PaliGemma: prompt = block 0
PADDING = padded_mask()
LEFT = torch.tensor([3, 0])  # PADDING's left padding, as create_chunked_causal_mask counts it
EXACT = {  # (transformers' function, attention_mask, position_ids, what the mask should be)
    "gemma3 global layer": (
        mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(IMAGES)), None, None,
        "bidirectional_spans"),
    "gemma3 sliding layer (blocks in the window)": (
        mu.and_masks(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(IMAGES)),
                     mu.sliding_window_overlay(4)), None, None, "bidirectional_spans"),
    "sliding window, blocks beyond it": (
        mu.or_masks(mu.sliding_window_causal_mask_function(3), mu.blockwise_overlay(IMAGES)),
        None, None, "bidirectional_spans"),
    "images in padded rows": (
        mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(IMAGES)), PADDING, None,
        "bidirectional_spans"),
    "paligemma prompt": (
        mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(PROMPT)), None, None,
        "prefix"),
    "llama4 chunks of 4, padded rows": (
        mu.chunked_causal_mask_function(4, LEFT), PADDING, None, "chunked"),
    "chunks of 4 in packed documents": (
        packed(mu.chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long))), None,
        PACKED, "chunked"),
    "images in packed documents": (
        mu.and_masks(mu.or_masks(mu.remap_positions_for_packed_sequence(
            mu.causal_mask_function, PACKED), mu.blockwise_overlay(IMAGES)),
            mu.packed_sequence_mask_function(mu.find_packed_sequence_indices(PACKED))),
        None, PACKED, "bidirectional_spans"),
}


def exact_boolean(fn, padding, positions) -> torch.Tensor:
    """[2, S, S] bool: the pairs ``exact`` keeps over the sequences the backend runs."""
    batch = schedules.batch.split(None, (2, S), attention_mask=padding, position_ids=positions)
    seqs = _sequences(batch if batch.packed else None, (2, S), sharded=False)
    mask = exact(fn, seqs)
    got = torch.zeros(2, S, S, dtype=torch.bool)
    for i, (b, cols) in enumerate(zip(seqs.row, seqs.columns)):
        n = torch.arange(len(cols))
        got[b, cols[:, None], cols[None]] = mask.visible(torch.tensor(i), n[:, None], n[None])
    return got, mask


@pytest.mark.parametrize("what", list(EXACT))
def test_exact_is_the_mask_transformers_makes(what):
    fn, padding, positions, kind = EXACT[what]
    assert read(fn, CALL).matter
    want = mu.sdpa_mask(2, S, S, mask_function=fn, allow_is_causal_skip=False,
                        attention_mask=None if padding is None else padding.bool())[:, 0]
    got, mask = exact_boolean(fn, padding, positions)
    real = torch.ones(2, S, dtype=torch.bool) if padding is None else padding.bool()
    assert torch.equal(got[real], want[real]), what
    assert kind in repr(mask)


def test_exact_names_what_it_cannot_run():
    """Gemma 3's sliding layers on packed documents put the image blocks inside the remapped
    positions (transformers then reads block ids by position in the document)."""
    fn = packed(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(IMAGES)))
    with pytest.raises(Unsupported, match="image blocks inside packed documents' remapped "
                                          "positions"):
        exact_boolean(fn, None, PACKED)
    holes = torch.ones(2, S, dtype=torch.long)
    holes[0, 5:7] = 0
    with pytest.raises(Unsupported, match=r"chunked attention \(chunked_overlay\) over a "
                                          r"sequence whose tokens are not at positions"):
        exact_boolean(mu.chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long)),
                      holes, None)
    twice = torch.cat([blocks((1, 3)), blocks()])
    twice[0, 6:8] = 0  # block 0 again, after text
    with pytest.raises(Unsupported, match="an image block .* not one run"):
        exact_boolean(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(twice)),
                      None, None)


TOP_LEFT = [  # (band of q - kv, shift: the first query's position minus the first key's)
    (Band(0, None), 0, (True, None)),          # causal
    (Band(0, 3), 0, (True, (3, 0))),           # a window of 4: the query and 3 keys before
    (Band(None, None), 0, (False, None)),      # bidirectional
    (Band(-2, 2), 0, (False, (2, 2))),         # a bidirectional window
    (Band(0, None), 5, (False, (None, 5))),    # a chunk after 5 cached tokens: bottom-right
    (Band(0, 3), 3, (False, (0, 3))),          # decoding with a window of 4 over 4 keys
]


@pytest.mark.parametrize("band,shift,want", TOP_LEFT, ids=[str(c[:2]) for c in TOP_LEFT])
def test_a_band_is_a_top_left_window(band, shift, want):
    assert _top_left(band, shift) == want


def test_read_dense_reads_causal_padding_and_windows():
    made = mu.sdpa_mask(2, S, S, mask_function=mu.sliding_window_causal_mask_function(4),
                        attention_mask=padded_mask().bool(), allow_is_causal_skip=False)
    band, keys = read_dense(made, S, S)
    assert band == Band(0, 3) and torch.equal(keys, padded_mask().bool())
    band, keys = read_dense(torch.ones(1, 1, S, S, dtype=torch.bool).tril(), S, S)
    assert band == Band(0, None) and bool(keys.all())
    with pytest.raises(Unsupported, match="a prepared 4-D mask with a KV cache"):
        read_dense(torch.ones(1, 1, 1, S, dtype=torch.bool), 1, S)


# ---- sliding windows ------------------------------------------------------------------------
FAMILIES = {
    "mistral, default window": (transformers.MistralForCausalLM,
                                dict(cls=transformers.MistralConfig)),
    "mistral, window 4": (transformers.MistralForCausalLM,
                          dict(cls=transformers.MistralConfig, sliding_window=4)),
    "qwen2, windowed layers": (transformers.Qwen2ForCausalLM,
                               dict(cls=transformers.Qwen2Config, num_hidden_layers=4,
                                    use_sliding_window=True, sliding_window=4,
                                    max_window_layers=2)),
    "gemma2, mixed layers": (transformers.Gemma2ForCausalLM,
                             dict(cls=transformers.Gemma2Config, num_hidden_layers=4,
                                  sliding_window=4, attn_logit_softcapping=None)),
    "gemma3, mixed layers": (transformers.Gemma3ForCausalLM,
                             dict(cls=transformers.Gemma3TextConfig, num_hidden_layers=4,
                                  sliding_window=4, sliding_window_pattern=2,
                                  query_pre_attn_scalar=16)),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    model_cls, changes = FAMILIES[request.param]
    changes = dict(changes)
    return request.param, twins(model_cls, config(changes.pop("cls"), **changes))


def test_the_windows_are_each_layers_own(family):
    name, (_, ours) = family
    windows = [layer.self_attn.config.sliding_window if name.startswith("mistral")
               else layer.self_attn.sliding_window for layer in ours.model.layers]
    want = {"mistral, default window": [4096] * 2, "mistral, window 4": [4] * 2,
            "qwen2, windowed layers": [None, None, 4, 4]}.get(name, [4, None, 4, None])
    assert windows == want


def test_dense(family):
    _, models = family
    assert_same(models, input_ids=ids(s=S))
    assert_same(models, input_ids=ids(b=1, s=12))  # shorter than Mistral's default window


def test_padded(family):
    _, models = family
    mask = padded_mask()
    assert_same(models, mask.bool(), input_ids=ids(s=S), attention_mask=mask,
                labels=padded_labels(mask))


def test_packed(family):
    _, models = family
    assert_same(models, input_ids=ids(s=S), position_ids=PACKED)


def test_packed_cu_seq_lens(family):
    """DataCollatorWithFlattening's flash kwargs: documents 5, 4 and 7 long in one row."""
    _, (theirs, ours) = family
    row, positions = ids(b=1, s=S), torch.tensor([[*range(5), *range(4), *range(7)]])
    cu = torch.tensor([0, 5, 9, 16], dtype=torch.int32)
    want = theirs(input_ids=row, position_ids=positions, use_cache=False).logits
    got = ours(input_ids=row, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
               max_length_q=7, max_length_k=7, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_generation(family):
    """Greedy generation past the window: a dynamic cache, then a static one (sliding
    layers keep a rolling cache of the window, global ones the whole sequence)."""
    _, models = family
    prompt = ids(b=1, s=6)
    assert_same_generation(models, prompt)
    assert_same_generation(models, prompt, cache_implementation="static")


def test_gradient_checkpointing():
    """Mistral with a window of 4, trained with gradient checkpointing."""
    models = twins(transformers.MistralForCausalLM,
                   config(transformers.MistralConfig, sliding_window=4))
    for model in models:
        model.train()
        model.activation_checkpointing_enable()
    assert_same(models, input_ids=ids(s=S), position_ids=PACKED)


def test_a_prepared_4d_mask_with_a_window():
    """A bool 4-D mask (sliding window of 4 and padding, as transformers' sdpa_mask makes
    it) given to the model: against transformers' "sdpa" (eager adds bool masks)."""
    models = twins(transformers.MistralForCausalLM,
                   config(transformers.MistralConfig, sliding_window=4), reference="sdpa")
    made = mu.sdpa_mask(2, S, S, mask_function=mu.sliding_window_causal_mask_function(4),
                        attention_mask=padded_mask().bool(), allow_is_causal_skip=False)
    assert_same(models, padded_mask().bool(), input_ids=ids(s=S), attention_mask=made,
                labels=padded_labels(padded_mask()))
    made = mu.sdpa_mask(1, S, S, mask_function=mu.sliding_window_causal_mask_function(4),
                        allow_is_causal_skip=False)  # [1, 1, S, S]: one for every row
    assert_same(models, input_ids=ids(s=S), attention_mask=made)


# ---- what the backend cannot run ------------------------------------------------------------
def gemma3_with_images():
    return twins(transformers.Gemma3ForConditionalGeneration, gemma3_config())


def image_batch(b=2, s=12, padding=None):
    """Rows with an image of 4 tokens at 3-6 (row 0) and 6-9 (row 1), their pixels and
    token_type_ids; labels -100 on padding and its predictions."""
    row = ids(b=b, s=s)
    row[0, 3:7] = IMAGE
    row[1, 6:10] = IMAGE
    batch = dict(input_ids=row, pixel_values=torch.randn(b, 3, 16, 16,
                                                         generator=torch.Generator().manual_seed(3)),
                 token_type_ids=(row == IMAGE).long())
    if padding is not None:
        labels = row.masked_fill(padding == 0, -100)
        labels[:, 1:][padding[:, :-1] == 0] = -100
        batch.update(attention_mask=padding, labels=labels)
    return batch


def assert_same_step(models, real=None, **inputs):
    """Logits (of the ``real`` tokens) and loss to the fp32 tolerance, and the gradients of
    one training step to it relative to each gradient's largest entry (the random vision
    tower makes the projector's gradients ~1e7)."""
    inputs.setdefault("labels", inputs["input_ids"])
    got = []
    for model in models:
        model.train()
        model.zero_grad()
        out = model(**inputs, use_cache=False)
        out.loss.backward()
        got.append((out.logits.detach(), out.loss.detach(),
                    {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (want_logits, want_loss, want_grads), (logits, loss, grads) = got
    real = torch.ones(logits.shape[:2], dtype=torch.bool) if real is None else real
    torch.testing.assert_close(logits[real], want_logits[real], **TOL)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert grads.keys() == want_grads.keys() and grads
    for name, want in want_grads.items():
        top = want.abs().max().clamp_min(1)
        torch.testing.assert_close(grads[name] / top, want / top, **TOL,
                                   msg=lambda m: f"{name}: {m}")


def test_gemma3_with_images_is_transformers_own():
    """Gemma 3's image tokens see each other (bidirectional blocks, windowed on the sliding
    layers): logits at every position, the image's included, loss and one step's gradients
    against eager; left-padded rows; a text batch with and without token_type_ids."""
    models = gemma3_with_images()
    assert_same_step(models, **image_batch())
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[0, :2] = padding[1, 11:] = 0
    assert_same_step(models, padding.bool(), **image_batch(padding=padding))
    text = ids(b=2, s=12)
    assert_same(models, input_ids=text)
    assert_same(models, input_ids=text, token_type_ids=torch.zeros_like(text))


def test_image_blocks_with_a_kv_cache_are_a_value_error():
    """A chunk of queries after cached tokens whose image block sees later keys."""
    _, ours = gemma3_with_images()
    first = image_batch()
    out = ours(input_ids=first["input_ids"][:, :4], token_type_ids=first["token_type_ids"][:, :4],
               use_cache=True)
    with pytest.raises(ValueError, match="runs image blocks and chunked attention without a "
                                         "KV cache"):
        ours(input_ids=first["input_ids"][:, 4:], token_type_ids=first["token_type_ids"],
             cache=out.past_key_values, use_cache=True)


def llama4(chunk=8):
    cfg = config(transformers.Llama4TextConfig, attention_chunk_size=chunk,
                 intermediate_size_mlp=128, num_local_experts=2, no_rope_layers=[1, 0])
    return twins(transformers.Llama4ForCausalLM, cfg)


def test_llama4_chunked_attention_is_transformers_own():
    """Chunks of 8 on 16 tokens (masks.chunked): dense, left- and right-padded rows."""
    models = llama4()
    assert_same(models, input_ids=ids(s=8))  # one chunk: causal
    assert_same(models, input_ids=ids(s=S))
    mask = padded_mask()
    assert_same(models, mask.bool(), input_ids=ids(s=S), attention_mask=mask,
                labels=padded_labels(mask))


def test_a_models_own_mask_function_is_a_value_error():
    """Gemma 3's use_bidirectional_attention overlays a mask function of its own."""
    cfg = config(transformers.Gemma3TextConfig, sliding_window=4, query_pre_attn_scalar=16,
                 use_bidirectional_attention=True)
    _, ours = twins(transformers.Gemma3ForCausalLM, cfg)
    with pytest.raises(ValueError, match=r"a custom mask function \(transformers\.models\."
                                         r"gemma3\.modeling_gemma3\.Gemma3TextModel"):
        ours(input_ids=ids(s=S), use_cache=False)


def test_a_mask_that_disagrees_with_its_layer_is_a_value_error():
    """A full-attention layer told to slide (eager would follow the mask, flash the layer)."""
    cfg = config(transformers.Qwen2Config, num_hidden_layers=4, use_sliding_window=True,
                 sliding_window=4, max_window_layers=2)
    _, ours = twins(transformers.Qwen2ForCausalLM, cfg)
    ours.model.layers[0].self_attn.sliding_window = 4
    with pytest.raises(ValueError, match="the mask transformers built keeps causal pairs, but "
                                         "the layer asks for causal pairs in a sliding window "
                                         "of 4 tokens"):
        ours(input_ids=ids(s=S), use_cache=False)


def test_a_window_over_padding_with_holes_is_a_value_error():
    _, ours = twins(transformers.MistralForCausalLM,
                    config(transformers.MistralConfig, sliding_window=4))
    mask = torch.ones(1, S, dtype=torch.long)
    mask[0, 5:7] = 0
    with pytest.raises(ValueError, match="padding between real tokens of a row"):
        ours(input_ids=ids(b=1, s=S), attention_mask=mask, use_cache=False)
