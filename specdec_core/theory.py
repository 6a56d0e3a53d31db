"""The expected-speedup model of Leviathan et al. (2023), and the same with a real verify cost.

a: acceptance rate (each drafted token accepted independently with probability a)
k: draft length
c: cost of one draft step relative to one target step
v: cost of the target's (k+1)-token verification pass relative to a one-token step
   (the paper takes v = 1: free parallelism; on a CPU it is not)
"""
from __future__ import annotations

from dataclasses import dataclass
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


def best_k(a: float, c: float, v_of_k=lambda k: 1.0, k_max: int = 16) -> int:
    return max(range(1, k_max + 1), key=lambda k: expected_speedup(a, k, c, v_of_k(k)))


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
    (`sizes`: n -> cost, linear between the sizes measured and past the last) and one draft forward."""
    sizes: dict[int, float]
    draft: float = 0.0

    def verify(self, n: int) -> float:
        points = sorted(self.sizes.items())
        (n0, c0), (n1, c1) = next(((a, b) for a, b in pairwise(points) if n <= b[0]), points[-2:])
        return c0 + (c1 - c0) * (n - n0) / (n1 - n0)


def expected_tree_tokens(path_probs: list[float]) -> float:
    """Tokens a tree round is expected to commit: 1 (the target's own) + the probability that each node is
    accepted, its path probability if the draft's probabilities were the target's (EAGLE-2's estimate)."""
    return 1.0 + sum(path_probs)


def tree_size(ranked: list[float], costs: PassCosts | None, forwards: int = 1) -> int:
    """How many of the nodes, best first (`ranked`: their path probabilities), to verify: the count that
    maximises expected tokens over the round's cost (`forwards` draft forwards and a pass of n + 1 tokens).
    Without measured costs, all of them."""
    if costs is None or len(costs.sizes) < 2:
        return len(ranked)
    value = lambda n: expected_tree_tokens(ranked[:n]) / (forwards * costs.draft + costs.verify(n + 1))
    return max(range(len(ranked) + 1), key=value)
