"""Train a transformers Llama with its attention over a mesh, checked against one process.

    mpirun -np 4 python examples/transformers_llama.py ring        # or allgather, ulysses, head_parallel
    mpirun -np 2 python examples/transformers_llama.py ring packed # or dense, padded (default)
    torchrun --nproc-per-node 2 examples/transformers_llama.py head_parallel

Needs transformers (pip install 'sdpa-fusion[transformers]'). Every rank builds the same small
random Llama with attn_implementation="fusion_attention" and the same batch (rows padded to one
length, or packed documents); shard_batch gives each rank its tokens, their positions and its
share of the loss; sum_gradients adds the replicated weights' gradients over the ranks that
split the tokens. After a few SGD steps the losses, logits and weights are compared with one
process training the same model with transformers' own attention on the whole batch. On CPUs:
gloo, fp32 and the reference kernel; on GPUs: NCCL, bf16 and the fastest kernel.
"""

from __future__ import annotations

import sys

import torch
import transformers

import schedules
import sdpa_fusion
from schedules.integrations import transformers as sdpa_transformers


def model_config(cuda: bool):
    """A small Llama: 4 heads of 16 (2 K/V heads) on CPUs, 8 heads of 64 (4 K/V) on GPUs."""
    heads, head_dim = (8, 64) if cuda else (4, 16)
    return transformers.LlamaConfig(
        vocab_size=512 if cuda else 97, hidden_size=heads * head_dim,
        intermediate_size=2 * heads * head_dim, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=heads // 2, max_position_embeddings=4096)


def make_batch(kind: str, rows: int, length: int, vocab: int, device) -> dict:
    """input_ids and labels ("dense"), with the padding mask (kind "padded": row i has
    length - 3*i real tokens, alternately left- and right-padded) or the packed positions
    (kind "packed": two documents per row); labels -100 where no token is predicted."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    labels = ids.clone()
    batch = {"input_ids": ids}
    if kind == "padded":
        mask = torch.ones(rows, length, dtype=torch.long)
        for i in range(1, rows):
            pad = 3 * i
            mask[i, :pad] = 0 if i % 2 else 1
            mask[i, length - pad:] = 1 if i % 2 else 0
        labels[mask == 0] = -100
        labels[torch.arange(rows), mask.argmax(1)] = -100  # nothing predicts a row's first token
        batch["attention_mask"] = mask
    elif kind == "packed":
        cut = torch.randint(1, length, (rows,), generator=g)
        position = torch.arange(length).expand(rows, length)
        batch["position_ids"] = torch.where(position < cut[:, None], position,
                                            position - cut[:, None])
        labels[batch["position_ids"] == 0] = -100
    elif kind != "dense":
        raise ValueError(f"kind={kind!r}: choose 'dense', 'padded' or 'packed'")
    batch["labels"] = labels
    return {name: t.to(device) for name, t in batch.items()}


def train(model, batch: dict, steps: int, sched=None):
    """(losses, first-step logits, final weights) of SGD on ``batch``: one process, or this
    rank's part under ``sched`` (the losses and logits of the whole batch, every rank)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, logits = [], None
    for _ in range(steps):
        sharded = sdpa_transformers.shard_batch(sched, **batch) if sched is not None else None
        out = model(**sharded.inputs) if sharded is not None else model(**batch, use_cache=False)
        out.loss.backward()
        if sharded is not None:
            sharded.sum_gradients(model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sharded.total(out.loss) if sharded is not None else out.loss.detach())
        if logits is None:
            logits = sharded.unshard(out.logits.detach()) if sharded is not None else out.logits
    return torch.stack(losses), logits.detach(), model.state_dict()


def run(mesh, schedule_name: str, *, kind: str = "padded", steps: int = 3) -> dict:
    """Train under ``schedule_name`` and one process; the largest differences found."""
    cuda = mesh.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    config = model_config(cuda)
    rows, length = (4, 1024) if cuda else (2, 16)
    batch = make_batch(kind, rows, length, config.vocab_size, mesh.device)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).to(mesh.device, dtype).train()
    reference.set_attn_implementation("sdpa" if cuda else "eager")
    model = transformers.LlamaForCausalLM(model_config(cuda)).to(mesh.device, dtype).train()
    model.load_state_dict(reference.state_dict())
    model.set_attn_implementation(sdpa_transformers.register())
    assert reference.config._attn_implementation != model.config._attn_implementation

    sched = schedules.get(schedule_name, mesh)
    losses, logits, weights = train(model, batch, steps, sched)
    want_losses, want_logits, want_weights = train(reference, batch, steps)
    real = batch["attention_mask"].bool() if "attention_mask" in batch else slice(None)
    return {
        "losses": losses.float().tolist(), "one process": want_losses.float().tolist(),
        "loss": (losses.float() - want_losses.float()).abs().max().item(),
        "logits": (logits[real].float() - want_logits[real].float()).abs().max().item(),
        "weights": max((weights[n].float() - w.float()).abs().max().item()
                       for n, w in want_weights.items()),
        "tokens": (rows, length), "dtype": str(dtype).removeprefix("torch."),
    }


def main(argv) -> int:
    name = argv[1] if len(argv) > 1 else "ring"
    kind = argv[2] if len(argv) > 2 else "padded"
    mesh = sdpa_fusion.init_mesh((-1,), ("seq",))
    checked = run(mesh, name, kind=kind)
    if mesh.rank == 0:
        rows, length = checked["tokens"]
        print(f"{name} over {mesh.size()} ranks on {mesh.device}: a Llama trained 3 SGD steps "
              f"on a {kind} batch of {rows} x {length} tokens ({checked['dtype']})")
        print(f"  losses {[round(x, 5) for x in checked['losses']]}, one process "
              f"{[round(x, 5) for x in checked['one process']]}")
        print(f"  max |difference| from one process: loss {checked['loss']:.1e}, logits of real "
              f"tokens {checked['logits']:.1e}, weights after training {checked['weights']:.1e}")
    sdpa_fusion.close_mesh()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
