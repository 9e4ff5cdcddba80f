"""Draw the pictures of docs/schedules.md from the schedules' own code.

    python docs/draw_schedules.py            # docs/images/*.png and the text diagrams in schedules.md
    python docs/draw_schedules.py --check    # exit 1 when schedules.md's diagrams are stale

Every picture is computed, not typed: token owners from the partitions (``indices``), each
ring step's computed query-key pairs from ``ring.block_case`` and ``ring.dense_call``, the
all-gather's kernel calls from ``allgather.gathered_calls``, and the hybrid's placement from
``Hybrid.indices`` on a ``VirtualMesh`` (no process group).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

import schedules
from schedules import partition as partitions
from schedules.allgather import gathered_calls
from schedules.ring import block_case, dense_call
from sdpa_fusion.mesh import VirtualMesh

DOCS = Path(__file__).resolve().parent
S, P = 16, 4  # tokens and ranks of every picture
PARTITIONS = ("contiguous", "load_balanced", "striped")
MARK = re.compile(r"(<!-- drawn: (\S+) -->\n```text\n)(.*?)(```\n)", re.S)


# ---- what the code does ------------------------------------------------------------------
def owners(name: str, seq: int = S, parts: int = P) -> list[int]:
    """The rank holding each token of a sequence."""
    owner = [0] * seq
    for rank in range(parts):
        for t in partitions.get(name).indices(seq, parts, rank).tolist():
            owner[t] = rank
    return owner


def ring_step(name: str, step: int, rank: int, causal: bool = True):
    """(source rank, Block case, [S, S] bool of the query-key pairs ``rank`` computes at
    ``step``) of the ring with partition ``name``."""
    part = partitions.get(name)
    source = (rank - step) % P
    case = block_case(rank, source, causal, part)
    pairs = torch.zeros(S, S, dtype=torch.bool)
    call = dense_call(case, S // P, S // P)
    if call is not None:
        rows = part.indices(S, P, rank)[call.rows]
        keys = part.indices(S, P, source)[call.keys]
        block = torch.ones(len(rows), len(keys), dtype=torch.bool)
        if call.causal:
            block = block.tril()
        pairs[rows[:, None], keys[None, :]] = block
    return source, case, pairs


def allgather_pairs(name: str, rank: int) -> tuple[torch.Tensor, list[str]]:
    """[S, S] computed pairs of ``rank`` under causal allgather: 1 for the own block, 2 for
    the calls over the gathered keys; and a line per call."""
    part = partitions.get(name)
    mine = part.indices(S, P, rank)
    pairs = torch.zeros(S, S, dtype=torch.long)
    pairs[mine[:, None], mine[None, :]] = torch.ones(len(mine), len(mine)).tril().long()
    others = torch.tensor([t for t in range(S) if t not in set(mine.tolist())])
    lines = [f"own block: tokens {_tokens(mine)} x themselves, causal"]
    for rows, n in gathered_calls(mine, S, S // P, causal=True):
        pairs[mine[rows][:, None], others[:n][None, :]] = 2
        lines.append(f"tokens {_tokens(mine[rows])} x gathered keys {_tokens(others[:n])}")
    return pairs, lines


def hybrid_owner(inner: str) -> list[list[int]]:
    """[heads][tokens] -> rank under hybrid (inner x ring) on a 2 x 2 mesh, 4 heads."""
    heads, owner = 4, [[-1] * S for _ in range(4)]
    for rank in range(P):
        sched = schedules.get("hybrid", VirtualMesh((2, 2), ("heads", "seq"), rank=rank),
                              inner=inner)
        tokens = sched.indices(S).tolist()
        mine = range(heads) if inner == "ulysses" else \
            range(sched.inner.index * heads // 2, (sched.inner.index + 1) * heads // 2)
        for h in mine:
            for t in tokens:
                owner[h][t] = rank
    return owner


def _tokens(t) -> str:
    """'0-3, 12-15' for runs of consecutive tokens."""
    values, runs = sorted(int(x) for x in t), []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


# ---- text diagrams -----------------------------------------------------------------------
def text_partitions() -> str:
    lines = [f"S = {S} tokens on P = {P} ranks (each digit: the rank holding that token)", ""]
    lines += [f"{name:>14}  " + " ".join("".join(map(str, owners(name)[i:i + 4]))
                                          for i in range(0, S, 4)) for name in PARTITIONS]
    return "\n".join(lines)


def text_ring(name: str) -> str:
    part = partitions.get(name)
    lines = [f"causal ring, partition {name}: rank r holds tokens "
             + "; ".join(f"r{r}: {_tokens(part.indices(S, P, r))}" for r in range(P))]
    for step in range(P):
        moves = "then every rank sends the K/V it holds to rank r+1" if step < P - 1 else \
            "last step: nothing moves"
        lines.append(f"step {step} ({moves}):")
        for rank in range(P):
            source, case, pairs = ring_step(name, step, rank)
            lines.append(f"  rank {rank} holds K/V of rank {source}: {case.value}"
                         + (f" ({int(pairs.sum())} pairs)" if case.name != "SKIP" else ""))
    return "\n".join(lines)


def text_allgather() -> str:
    lines = ["causal allgather, load_balanced: every rank all-gathers K/V while it attends "
             "its own block, then"]
    for rank in range(P):
        _, calls = allgather_pairs("load_balanced", rank)
        lines.append(f"  rank {rank}: " + "; ".join(calls))
    return "\n".join(lines)


def text_hybrid(inner: str) -> str:
    owner = hybrid_owner(inner)
    lines = [f"hybrid inner={inner}, outer=ring (load_balanced) on a 2 x 2 mesh (heads x seq), "
             f"4 heads: rank holding (head, token) as it enters attention()"]
    lines += [f"  head {h}  " + " ".join("".join(map(str, row[i:i + 4])) for i in range(0, S, 4))
              for h, row in enumerate(owner)]
    return "\n".join(lines)


TEXTS = {
    "partitions": text_partitions,
    **{f"ring-{name}": (lambda name=name: text_ring(name)) for name in PARTITIONS},
    "allgather": text_allgather,
    "hybrid-ulysses": lambda: text_hybrid("ulysses"),
    "hybrid-head_parallel": lambda: text_hybrid("head_parallel"),
}


def fill(markdown: str) -> str:
    """``markdown`` with every ``<!-- drawn: NAME -->`` text block redrawn."""
    return MARK.sub(lambda m: m.group(1) + TEXTS[m.group(2)]() + "\n" + m.group(4), markdown)


# ---- pictures ----------------------------------------------------------------------------
def draw(out: Path) -> list[Path]:
    """The PNGs of docs/schedules.md, written into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    colors = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759"]
    ranks = ListedColormap(["white", *colors])
    masked = ListedColormap(["white", "#eeeeee", *colors])
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    def save(fig, name):
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)

    fig, axes = plt.subplots(len(PARTITIONS), 1, figsize=(7, 2.4))
    for ax, name in zip(axes, PARTITIONS):
        ax.imshow([[o + 1 for o in owners(name)]], cmap=ranks, vmin=0, vmax=P)
        for t, o in enumerate(owners(name)):
            ax.text(t, 0, str(o), ha="center", va="center", color="white", fontsize=9)
        ax.set_yticks([0], [name])
        ax.set_xticks(range(S))
        ax.tick_params(labelsize=8)
    axes[-1].set_xlabel("token (each cell: the rank holding it)")
    save(fig, "partitions")

    for name in PARTITIONS:
        fig, axes = plt.subplots(P, P, figsize=(8.5, 9))
        for step in range(P):
            for rank in range(P):
                source, case, pairs = ring_step(name, step, rank)
                ax = axes[step][rank]
                grid = torch.ones(S, S, dtype=torch.long).tril()  # the causal mask, in gray
                grid[pairs] = source + 2
                ax.imshow(grid.numpy(), cmap=masked, vmin=0, vmax=P + 1)
                ax.set_xticks([])
                ax.set_yticks([])
                ax.set_title(f"step {step}, rank {rank}\nK/V of rank {source}", fontsize=8)
        fig.suptitle(f"ring, {name}, causal: query (rows) x key (columns) pairs each rank "
                     f"computes per step,\ncolored by the rank whose K/V block it holds (gray: "
                     f"the causal mask); after each step the block moves to rank r+1",
                     fontsize=9)
        save(fig, f"ring_{name}")

    fig, axes = plt.subplots(1, P, figsize=(9, 2.8))
    for rank, ax in enumerate(axes):
        pairs, _ = allgather_pairs("load_balanced", rank)
        ax.imshow(pairs.numpy(), cmap=ListedColormap(["white", colors[rank], "#bab0ac"]), vmin=0, vmax=2)
        ax.set_title(f"rank {rank}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle("allgather, load_balanced, causal: own block (color) while K/V are gathered, "
                 "then the gathered keys (gray)", fontsize=9)
    save(fig, "allgather")

    fig, axes = plt.subplots(1, 2, figsize=(8, 2.6))
    heads = 8
    before = [[owners("load_balanced")[t] + 1 for t in range(S)] for _ in range(heads)]
    after = [[h // (heads // P) + 1] * S for h in range(heads)]
    for ax, grid, title in ((axes[0], before, "before the all-to-all: tokens split"),
                            (axes[1], after, "after: heads split, every token")):
        ax.imshow(grid, cmap=ranks, vmin=0, vmax=P)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("token", fontsize=8)
        ax.set_ylabel("head", fontsize=8)
    fig.suptitle("ulysses: which rank holds each (head, token) of q, k, v", fontsize=9)
    save(fig, "ulysses")

    fig, axes = plt.subplots(1, 2, figsize=(8, 2.2))
    for ax, inner in zip(axes, ("ulysses", "head_parallel")):
        ax.imshow([[o + 1 for o in row] for row in hybrid_owner(inner)], cmap=ranks, vmin=0,
                  vmax=P)
        ax.set_title(f"inner {inner} x outer ring (2 x 2)", fontsize=9)
        ax.set_xlabel("token", fontsize=8)
        ax.set_ylabel("head", fontsize=8)
    save(fig, "hybrid")
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="only check that schedules.md's text diagrams are current")
    args = parser.parse_args(argv)
    doc = DOCS / "schedules.md"
    current = doc.read_text()
    wanted = fill(current)
    if args.check:
        if wanted != current:
            print(f"{doc} is stale: run python docs/draw_schedules.py", file=sys.stderr)
            return 1
        return 0
    doc.write_text(wanted)
    for path in draw(DOCS / "images"):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
