"""What a drafter proposes (Draft), and the nodes a round fed to the draft's cache (CachedNodes; the tree they grew
in: trees.py). NoDrafter proposes nothing: plain decoding."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .events import chain


@dataclass
class Draft:
    tokens: torch.Tensor  # [k'] proposed ids, k' <= k
    q: torch.Tensor | None  # [k', V] distributions they were sampled from; None = deterministic drafter
    logits: torch.Tensor | None = None  # [k', V] raw draft logits, kept only for display (cfg.record_top)
    failed: torch.Tensor | None = None  # () bool on the device: the draft produced NaN or +inf logits
    parents: list[int] = None  # each node's parent (-1: the last committed token); a chain's by default
    expected: float = 0.0  # the draft's own estimate of the tokens the target will accept
    forwards: int = 0  # the draft's forwards (a model's; fewer than its tokens where guesses or a tree's levels saved some)
    curve: list[float] = field(default_factory=list)  # the policy's forecast before the round (policy.Policy.curve)
    gain: float = 0.0  # the policy's expected tokens per unit time of the round as drafted, relative to plain decoding
    step_ms: float = 0.0  # the target's step the policy priced the round against (0: none timed)
    verified_s: float = 0.0  # how long the target's pass over it took, read included (the engine's; 0: not yet)

    def __post_init__(self):
        if self.parents is None:
            self.parents = chain(len(self))

    def __len__(self) -> int:
        return self.tokens.numel()


class CachedNodes(NamedTuple):
    """The nodes a round fed to the draft's cache, from `start` on: their tokens, and each one's parent's slot
    among them (-1: the last committed token)."""
    start: int
    tokens: list[int]
    parents: list[int]


class NoDrafter:
    """Proposes nothing: every round is one plain target step. This is autoregressive decoding."""

    name = "none"

    def start(self, ids):
        return iter(())

    def propose(self, ids, k, cfg, generator):
        return Draft(torch.empty(0, dtype=torch.long), None)
