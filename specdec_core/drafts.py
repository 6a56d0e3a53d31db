"""What a drafter proposes (Draft), and the data a draft model's token tree grows in: its nodes, the draft as it
grows, and the nodes fed to the draft's cache (the draws themselves: sampling.children). NoDrafter proposes nothing:
plain decoding."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .events import chain
from .transfer import Transfer


@dataclass
class Draft:
    tokens: torch.Tensor  # [k'] proposed ids, k' <= k
    q: torch.Tensor | None  # [k', V] distributions they were sampled from; None = deterministic drafter
    logits: torch.Tensor | None = None  # [k', V] raw draft logits, kept only for display (cfg.record_top)
    failed: torch.Tensor | None = None  # () bool on the device: the draft produced NaN or +inf logits
    parents: list[int] = None  # each node's parent (-1: the last committed token); a chain's by default
    expected: float = 0.0  # the draft's own estimate of the tokens the target will accept
    steps: int = 0  # the draft's forwards (a model's; fewer than its tokens where guesses or a tree's levels saved some)
    curve: list[float] = field(default_factory=list)  # the policy's forecast before the round (policy.Policy.curve)
    gain: float = 0.0  # the policy's expected tokens per unit time of the round as drafted, relative to plain decoding

    def __post_init__(self):
        if self.parents is None:
            self.parents = chain(len(self))

    def __len__(self) -> int:
        return self.tokens.numel()


class Node(NamedTuple):
    """A drafted tree node."""
    token: int
    parent: int  # the parent's index among the nodes (-1: the last committed token)
    rank: float  # path probability under the draft, the j-th child counted at its parent's j-th largest probability
    q_row: int  # the row of the distribution it was drawn from (its parent's)
    sibling: int  # its place among its siblings, in the order drawn
    chain: bool  # on the chain: every node on its path a first child
    prob: float  # its own probability: its parent's j-th largest, the j-th child (rank is the product down to it)
    worth: float  # the chance the target accepts it and its path, as the policy calibrates the probabilities


class CachedNodes(NamedTuple):
    """The nodes a round fed to the draft's cache, from `start` on: their tokens, and each one's parent's slot
    among them (-1: the last committed token)."""
    start: int
    tokens: list[int]
    parents: list[int]


@dataclass
class GrowingDraft:
    """A draft as it grows: its nodes, the distributions (q, and the raw logits) of the rows they were drawn from,
    whether a row failed, and the nodes fed to the draft (by index)."""
    nodes: list[Node] = field(default_factory=list)
    qs: list[torch.Tensor] = field(default_factory=list)
    raw: list[torch.Tensor] = field(default_factory=list)
    failed: list[torch.Tensor] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)

    def add_level(self, frontier: list[int], top: torch.Tensor, picks: torch.Tensor, worth=lambda prob: prob) -> list[int]:
        """The children [len(frontier), width] drawn at the last rows, read in one transfer, as nodes: their indices.
        `worth(prob)`: the chance the target accepts a token of that draft probability once it reaches it."""
        level_read = Transfer()
        level_read.put("tops", top, floats=True)
        level_read.put("tokens", picks)
        tops, tokens = level_read.read().values()
        level, first_row = [], len(self.qs) - len(frontier)
        for f, parent in enumerate(frontier):
            up = self.nodes[parent] if parent >= 0 else Node(-1, -1, 1.0, -1, 0, True, 1.0, 1.0)
            for j, (token, prob) in enumerate(zip(tokens[f], tops[f])):
                if prob <= 0:  # the distribution has fewer tokens than `width`
                    break
                self.nodes.append(Node(token, parent, up.rank * prob, first_row + f, j, up.chain and j == 0, prob,
                                       up.worth * worth(prob)))
                level.append(len(self.nodes) - 1)
        return level


class NoDrafter:
    """Proposes nothing: every round is one plain target step. This is autoregressive decoding."""

    name = "none"

    def start(self, ids):
        return iter(())

    def propose(self, ids, k, cfg, generator):
        return Draft(torch.empty(0, dtype=torch.long), None)

    def commit(self, ids):
        pass
