"""The expected-speedup model of Leviathan et al. (2023), and the same with a real verify cost.

a: acceptance rate (each drafted token accepted independently with probability a)
k: draft length
c: cost of one draft step relative to one target step
v: cost of the target's (k+1)-token verification pass relative to a one-token step
   (the paper takes v = 1: free parallelism; on a CPU it is not)
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise


def expected_tokens_per_round(a: float, k: int) -> float:
    """(1 - a^(k+1)) / (1 - a): accepted tokens plus the target's own token."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def expected_speedup(a: float, k: int, c: float, v: float = 1.0) -> float:
    """Tokens per unit time relative to plain decoding: E[tokens per round] / (k c + v)."""
    return expected_tokens_per_round(a, k) / (k * c + v)


def predicted_speedup(a: float, lengths: list[int], c: float, v: float) -> float:
    """expected_speedup for a run whose rounds drafted these numbers of tokens (they vary when a
    draft stops early); v is the run's mean verify cost."""
    tokens = sum(expected_tokens_per_round(a, n) for n in lengths) / len(lengths)
    return tokens / (sum(lengths) / len(lengths) * c + v)


def measured_costs(ar, spec) -> tuple[float, float, float]:
    """(a, c, v) from one run's own Stats: acceptance rate, draft step / target step, verify pass / target step."""
    step = (ar.seconds - ar.prefill_s) / max(ar.tokens, 1)  # the target's one-token step
    c = spec.draft_s / max(spec.drafted, 1) / step if step > 0 else 0.0
    v = spec.verify_s / max(spec.rounds, 1) / step if step > 0 else 1.0
    return spec.acceptance_rate, c, v


def verify_cost_at(v: float, k_measured: float, k: int) -> float:
    """The verify pass's relative cost at another k, assuming it grows linearly with the tokens scored."""
    return 1.0 + (v - 1.0) * k / max(k_measured, 1)


@dataclass
class PassCosts:
    """Measured on the running device, relative to a one-token target step: a target pass of n tokens
    (`sizes`: n -> cost) and one draft forward.

    `verify(n)` reads the timings as a cost model: a pass never costs more than a larger one (it could be padded
    to that size), and between the sizes timed it follows their lower convex hull (extended past the last). So a
    tree's value, nodes added best first, rises and then falls, and its first maximum is its best (`tree_size`).
    """
    sizes: dict[int, float]
    draft: float = 0.0
    step_ms: float = 0.0  # the target's one-token step, where timed: what a drafter's own timings are relative to

    @cached_property
    def hull(self) -> list[tuple[int, float]]:
        points, cheapest = [], float("inf")
        for n, cost in sorted(self.sizes.items(), reverse=True):  # no dearer than any larger pass
            cheapest = min(cheapest, cost)
            points.append((n, cheapest))
        hull: list[tuple[int, float]] = []
        for point in reversed(points):  # Andrew's monotone chain, lower half
            while len(hull) >= 2 and cross(hull[-2], hull[-1], point) <= 0:
                hull.pop()
            hull.append(point)
        return hull

    def verify(self, n: int) -> float:
        hull = self.hull if len(self.hull) > 1 else self.hull * 2
        (n0, c0), (n1, c1) = next(((a, b) for a, b in pairwise(hull) if n <= b[0]), hull[-2:])
        return c0 + (c1 - c0) * (n - n0) / (n1 - n0) if n1 != n0 else c0


def cross(o, a, b) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def tree_size(ranked: list[float], costs: PassCosts | None, forwards: float = 1.0) -> int:
    """How many of the nodes, in the order given (`ranked`: their path probabilities), to verify: nodes are added
    while the expected tokens over the round's cost (`forwards` draft forwards and a pass of n + 1 tokens) rises,
    and the first fall ends the tree. Whether the j-th node is kept depends on the first j ranks alone, never on
    what comes after it (its own subtree included), and `forwards` must be fixed before the round is drawn: so a
    node is kept whatever its token turns out to be, as exact verification needs (verify.py).
    Without measured costs, all of them."""
    if costs is None or len(costs.sizes) < 2:
        return len(ranked)
    fixed, tokens = forwards * costs.draft, 1.0
    for n, rank in enumerate(ranked):
        if (tokens + rank) / (fixed + costs.verify(n + 2)) < tokens / (fixed + costs.verify(n + 1)):
            return n
        tokens += rank
    return len(ranked)
