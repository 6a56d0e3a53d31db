"""A draft's token tree as it grows, and which of its nodes a round verifies: functions of the nodes alone (their
tokens, parents, ranks and worths) and the costs, apart from the model that draws them (drafters.ModelDrafter), the
cache that holds them (drafters.DraftCache) and the policy that prices them (policy.Policy)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .theory import PassCosts, tree_size
from .transfer import Transfer


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

    def frontier(self, level: list[int], chain_node: int, expand: int, floor: float) -> list[int]:
        """The nodes fed next: the chain's, and the `expand` - 1 best others of the level whose rank is still at
        least `floor` (they grow while the draft believes in them as much as a chain must to go on)."""
        nodes = self.nodes
        others = sorted((i for i in level if i != chain_node and nodes[i].rank >= floor),
                        key=lambda i: (-nodes[i].rank, i))[: expand - 1]
        return sorted([chain_node, *others])  # parents before children, as TreeInput wants

    def kept(self, limit: int, costs: PassCosts | None, forwards: int) -> list[int]:
        """The nodes worth their rows in the target's pass, at most `limit`, in tree order: the chain first, then the
        others best first (every prefix is a tree: parents and earlier siblings come first), as many as their worths
        pay for (theory.tree_size; `costs` None: all of them)."""
        nodes = self.nodes
        order = sorted(range(len(nodes)), key=lambda i: (not nodes[i].chain, -nodes[i].rank, i))[:limit]
        return sorted(order[:tree_size([nodes[i].worth for i in order], costs, forwards)])


def verdicts(start: int, nodes: list[Node], ids: list[int]) -> list[tuple[int, float, bool]]:
    """What the target decided of a draft's `nodes` (their parents among them), read from the tokens it committed
    from `start` on: (depth, draft probability, accepted) of the first child judged at each depth along the path.
    A committed token that is one of a node's children is that child accepted (a rejected token is never the one
    put in its place); any other, every child there rejected."""
    out, at = [], -1
    for depth, token in enumerate(ids[start:], start=1):
        kids = [j for j, node in enumerate(nodes) if node.parent == at]
        if not kids:
            break
        out.append((depth, nodes[kids[0]].prob, nodes[kids[0]].token == token))
        at = next((j for j in kids if nodes[j].token == token), None)
        if at is None:
            break
    return out
