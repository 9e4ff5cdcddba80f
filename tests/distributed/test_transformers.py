"""A transformers Llama trained under every schedule equals one-process training.

    mpirun -np 2 python -m pytest tests/distributed/test_transformers.py
    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_transformers.py

A tiny random Llama (hidden 64, 4 heads, 2 K/V heads, 2 layers, fp32) trains 3 SGD steps on
CPU ranks with attn_implementation="fusion_attention" and batches sharded by the schedule
(``shard_batch``): dense, padded (left and right) and packed (documents restarting inside a
row), and DataCollatorWithFlattening's batch (flash kwargs) as it comes. A Mistral with a
sliding window of 4 tokens trains the same batches (the window per sequence, through
``window=``). A Gemma 3 with image tokens (token_type_ids; bidirectional blocks on a sliding
and a global layer, through ``mask=``) trains dense and padded batches. Every rank's losses, logits and weights equal those of one process training
the same model with transformers' own eager attention on the whole batch, to 1e-5. The
models have 4 heads, so the module runs on 2 and 4 ranks (skipped on more).
"""

from __future__ import annotations

import pytest
import torch

import schedules
import sdpa_fusion
from sdpa_fusion.mesh import launch_env
from tests.reference import tolerance
from tests.transformers_models import gemma3_config

_env = launch_env()
WORLD = _env.world_size if _env else 1
if WORLD > 4:
    pytest.skip("the test model has 4 heads; run it under -np 2 and -np 4",
                allow_module_level=True)

transformers = pytest.importorskip("transformers")
from schedules.integrations import transformers as sdpa_transformers  # noqa: E402
from schedules.documents import DocumentPacking  # noqa: E402

STEPS, LR, VOCAB, B, S = 3, 0.1, 97, 2, 16
TOL = tolerance(torch.float32)  # fp32 models, compared in the table's fp32 level
KINDS = ["dense", "padded", "packed"]
SCHEDULES = ["ring", "allgather", "ulysses", "head_parallel"]
HYBRIDS = ["ulysses", "head_parallel"]  # inner schedules of a 2 x 2 hybrid (4 ranks)


WINDOW = 4  # the sliding window of the Mistral model, shorter than every sequence


def config(cls=None, **changes):
    return (cls or transformers.LlamaConfig)(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        **changes)


def mistral(**changes):
    """A Mistral model with a sliding window of WINDOW tokens."""
    return transformers.MistralForCausalLM(config(transformers.MistralConfig,
                                                  sliding_window=WINDOW, **changes))


@pytest.fixture(scope="module")
def weights():
    """The initial weights of the test model, the same on every rank."""
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config()).state_dict()


@pytest.fixture(scope="module")
def backend():
    return sdpa_transformers.register(kernel="reference")


def model_with(weights, attention: str, make=None, **changes):
    model = make(**changes) if make else transformers.LlamaForCausalLM(config(**changes))
    model.load_state_dict(weights)
    model.set_attn_implementation(attention)
    return model.train()


def batch_of(kind: str) -> dict:
    """A [2, 16] batch, the same on every rank: input_ids, labels, and the padding mask or
    the packed positions. Labels are -100 where no loss is wanted (padding, the first token
    of a row or document)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = ids.clone()
    batch = {"input_ids": ids}
    if kind == "padded":  # row 0 left-padded by 3, row 1 right-padded by 5
        mask = torch.ones(B, S, dtype=torch.long)
        mask[0, :3] = mask[1, 11:] = 0
        labels[mask == 0] = -100
        labels[0, 3] = labels[1, 0] = -100  # a padding token's prediction is not counted
        batch["attention_mask"] = mask
    elif kind == "packed":  # documents of 5 + 11 and 7 + 9 tokens
        batch["position_ids"] = torch.tensor([[*range(5), *range(11)], [*range(7), *range(9)]])
        labels[batch["position_ids"] == 0] = -100
    batch["labels"] = labels
    return batch


def real_tokens(batch) -> torch.Tensor:
    mask = batch.get("attention_mask")
    return torch.ones(batch["input_ids"].shape, dtype=torch.bool) if mask is None else mask.bool()


def train_one_process(weights, batch, make=None):
    """(losses, first-step logits, final weights) of transformers' eager attention."""
    model = model_with(weights, "eager", make)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, logits = [], None
    for _ in range(STEPS):
        out = model(**batch, use_cache=False)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.detach())
        logits = out.logits.detach() if logits is None else logits
    return losses, logits, model.state_dict()


def train_sharded(weights, backend, sched, batch, make=None, **per_token):
    """The same training under ``sched``: (losses, first-step logits, final weights);
    ``per_token`` [B, S] model inputs are sharded like the tokens."""
    model = model_with(weights, backend, make)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, logits = [], None
    for _ in range(STEPS):
        sharded = sdpa_transformers.shard_batch(sched, **batch)
        local = {k: sharded.batch.shard(t) for k, t in per_token.items()}
        out = model(**sharded.inputs, **local)
        out.loss.backward()
        sharded.sum_gradients(model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sharded.total(out.loss))
        logits = sharded.unshard(out.logits.detach()) if logits is None else logits
    return losses, logits, model.state_dict()


@pytest.fixture(scope="module")
def one_process(weights):
    """One-process training of each kind of batch, made once."""
    made = {}

    def get(kind):
        if kind not in made:
            made[kind] = train_one_process(weights, batch_of(kind))
        return made[kind]

    return get


def assert_same_training(got, want, batch, what):
    (losses, logits, state), (want_losses, want_logits, want_state) = got, want
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), **TOL,
                               msg=lambda m: f"{what}, losses: {m}")
    real = real_tokens(batch)
    torch.testing.assert_close(logits[real], want_logits[real], **TOL,
                               msg=lambda m: f"{what}, logits of real tokens: {m}")
    for name, value in want_state.items():
        torch.testing.assert_close(state[name], value, **TOL, msg=lambda m: f"{what}, {name}: {m}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", SCHEDULES)
def test_training_equals_one_process(mesh, weights, backend, one_process, name, kind):
    batch = batch_of(kind)
    got = train_sharded(weights, backend, schedules.get(name, mesh), batch)
    assert_same_training(got, one_process(kind), batch, f"{name}, {kind} batch")


def collated() -> dict:
    """DataCollatorWithFlattening's batch (flash kwargs, seq_idx) of documents 3, 6, 2 and 9
    long: one row of 20 tokens."""
    g = torch.Generator().manual_seed(2)
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True,
                                                       return_seq_idx=True)
    docs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 6, 2, 9)]
    return collator([{"input_ids": d} for d in docs], return_tensors="pt")


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_collators_batch_trains_as_one_process(mesh, weights, backend, name):
    """shard_batch(sched, **collated): the documents of cu_seq_lens_q; one process trains
    on input_ids, labels and position_ids with eager attention."""
    batch = collated()
    plain = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
    got = train_sharded(weights, backend, schedules.get(name, mesh), batch)
    assert_same_training(got, train_one_process(weights, plain), plain, f"{name}, collated")


@pytest.mark.parametrize("name", ["ring", "allgather"])
def test_the_collators_documents_go_whole_to_ranks(mesh, weights, backend, name):
    """Partition documents: the collator's documents go whole to ranks where they can, the
    local position_ids count inside each document, and training is one process's."""
    batch = collated()
    plain = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
    sched = schedules.get(name, mesh, partition="documents")
    sharded = sdpa_transformers.shard_batch(sched, **batch)
    assert isinstance(sharded.batch.packing, DocumentPacking)
    tokens = sharded.batch.tokens[0]
    real = tokens >= 0
    assert torch.equal(sharded.inputs["position_ids"][0][real],
                       batch["position_ids"].flatten()[tokens[real]])
    got = train_sharded(weights, backend, sched, batch)
    assert_same_training(got, train_one_process(weights, plain), plain, f"{name}, documents")


@pytest.fixture(scope="module")
def mistral_weights():
    torch.manual_seed(0)
    return mistral().state_dict()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", SCHEDULES)
def test_a_sliding_window_trains_as_one_process(mesh, mistral_weights, backend, name, kind):
    batch = batch_of(kind)
    want = train_one_process(mistral_weights, batch, mistral)
    got = train_sharded(mistral_weights, backend, schedules.get(name, mesh), batch, mistral)
    assert_same_training(got, want, batch, f"window {WINDOW}, {name}, {kind} batch")


def image_batch(kind: str) -> dict:
    """``batch_of(kind)`` with image tokens at 2-5 (row 0) and 9-13 (row 1), marked by
    token_type_ids (no pixels: the blocks are what the mask sees)."""
    batch = batch_of(kind)
    types = torch.zeros(B, S, dtype=torch.long)
    types[0, 2:6] = types[1, 9:14] = 1
    batch["token_type_ids"] = types
    return batch


@pytest.fixture(scope="module")
def gemma3_weights():
    torch.manual_seed(0)
    return transformers.Gemma3ForConditionalGeneration(gemma3_config()).state_dict()


def gemma3():
    return transformers.Gemma3ForConditionalGeneration(gemma3_config())


@pytest.mark.parametrize("kind", ["dense", "padded"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_image_tokens_train_as_one_process(mesh, gemma3_weights, backend, name, kind):
    batch = image_batch(kind)
    want = train_one_process(gemma3_weights, batch, gemma3)
    types = batch.pop("token_type_ids")
    got = train_sharded(gemma3_weights, backend, schedules.get(name, mesh), batch, gemma3,
                        token_type_ids=types)
    assert_same_training(got, want, batch, f"gemma3 images, {name}, {kind} batch")


@pytest.mark.parametrize("inner", HYBRIDS)
def test_hybrid_training_equals_one_process(mesh, weights, backend, one_process, inner):
    if WORLD != 4:
        pytest.skip("a 2 x 2 hybrid needs 4 ranks")
    sched = schedules.get("hybrid", sdpa_fusion.init_mesh((2, 2), ("heads", "seq")), inner=inner)
    batch = batch_of("dense")
    got = train_sharded(weights, backend, sched, batch)
    assert_same_training(got, one_process("dense"), batch, f"hybrid {inner} x ring")


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_model_with_attention_dropout_trains(mesh, weights, backend, name):
    """attention_dropout=0.2 under a schedule: the loss differs from the dropout-free one,
    is the same on every rank and the same again from the same seed."""
    sched = schedules.get(name, mesh)
    batch = batch_of("dense")

    def loss(dropout, seed):
        torch.manual_seed(seed)
        model = model_with(weights, backend, attention_dropout=dropout)
        sharded = sdpa_transformers.shard_batch(sched, **batch)
        out = model(**sharded.inputs)
        out.loss.backward()
        sharded.sum_gradients(model.parameters())
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        return sharded.total(out.loss)

    first, again, plain = loss(0.2, 5), loss(0.2, 5), loss(0.0, 5)
    assert torch.isfinite(first) and first == again and first != plain
    every = [None] * WORLD
    torch.distributed.all_gather_object(every, first.item())
    assert len(set(every)) == 1, f"ranks see different losses: {every}"


@pytest.mark.usefixtures("several_ranks")
def test_a_mask_with_a_sharded_batch_is_refused(mesh, weights, backend):
    """The sharded batch holds the padding: a mask passed to the model as well is a
    ValueError (raised on every rank: each one calls the model with it)."""
    batch = batch_of("padded")
    sharded = sdpa_transformers.shard_batch(schedules.get("ring", mesh), **batch)
    model = model_with(weights, backend)
    mask = torch.ones_like(sharded.inputs["input_ids"])
    mask[:, 0] = 0
    with pytest.raises(ValueError, match="call the model with batch.inputs only"):
        model(**sharded.inputs, attention_mask=mask)


@pytest.mark.parametrize("name,kind", [("ring", "padded"), ("head_parallel", "packed")])
def test_the_example_matches_one_process(mesh, name, kind):
    from examples.transformers_llama import run

    checked = run(mesh, name, kind=kind)
    assert max(checked["loss"], checked["logits"], checked["weights"]) < 1e-5, checked
