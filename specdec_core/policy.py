"""How far a round drafts: each round drafts only as far as the measured costs say it pays, 0 included.

A round that drafts n tokens costs its draft forwards (c each, relative to a target step) and a target pass of
n + 1 tokens (`PassCosts.verify`), and brings 1 + the sum, over its tokens, of the chance that the target accepts
every token up to that one. Plain decoding brings 1 token for 1 step. The policy learns the chances from this
answer's own verdicts, weighted toward the latest (`Verdicts`):
  - before a round, by depth (the chance the d-th token is accepted once the ones before it were): the forecast
    `curve`, expected tokens per unit time of drafting n = 0..k, and its best n; n = 0 is a plain step, with no draft
    forward at all;
  - the draft forward's cost as this answer's rounds measure it (its sampling and reads included), the passes' as
    timed (timing.tree_costs);
  - within a round, each drawn token's own draft probability, calibrated by the verdicts on tokens drafted with
    like probabilities (`worth`): the draft goes on while the next token's forecast worth raises the round's
    expected tokens per unit time (`go_on`), and a token tree keeps its nodes by the same rule (theory.tree_size).
It reads only the verdicts of earlier rounds and what the draft has drawn so far, never this round's verification:
so what it drafts is a function of the draft's own draws, as exact verification needs (verify.py).
"""
from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field

from .theory import PassCosts

DECAY = 0.95  # each round, every earlier verdict counts this much less: an answer's text changes as it goes
PRIOR_WEIGHT = 2.0  # verdicts' worth of belief before any: the draft's own probability, or the depth above's rate
PRIOR_ACCEPTANCE = 0.8
DRAFT_WEIGHT = 0.2  # how far each round's measured draft cost moves the one the policy uses
EDGES = (0.3, 0.5, 0.7, 0.85, 0.95)  # a token's draft probability, binned for calibration
MIDDLES = (0.15, 0.4, 0.6, 0.78, 0.9, 0.98)  # each bin's prior: what the draft itself believes


@dataclass
class Verdicts:
    """Exponentially weighted counts of judged and accepted draft tokens, by key."""
    judged: dict = field(default_factory=lambda: defaultdict(float))
    accepted: dict = field(default_factory=lambda: defaultdict(float))

    def rate(self, key, prior: float) -> float:
        return (self.accepted[key] + PRIOR_WEIGHT * prior) / (self.judged[key] + PRIOR_WEIGHT)

    def add(self, key, accepted: bool) -> None:
        self.judged[key] += 1.0
        self.accepted[key] += accepted

    def fade(self) -> None:
        for counts in (self.judged, self.accepted):
            for key in counts:
                counts[key] *= DECAY


class Policy:
    """One drafter's rule for how far to draft; `costs` None (not measured): always as far as asked."""

    def __init__(self, costs: PassCosts | None):
        self.costs = costs if costs is not None and len(costs.sizes) >= 2 else None
        self.by_depth, self.by_probability = Verdicts(), Verdicts()
        self.draft = costs.draft if costs is not None else 0.0  # a draft forward, in target steps, as last measured

    def observe(self, seconds: float, forwards: int) -> None:
        """A round's draft took `seconds` for `forwards` forwards, all included (the tokens it caught up on, its
        sampling, its reads): the cost of a forward moves toward what they cost, where the target's step was timed."""
        if self.costs is not None and self.costs.step_ms > 0 and forwards:
            self.draft += DRAFT_WEIGHT * (seconds * 1000 / forwards / self.costs.step_ms - self.draft)

    def forecast(self, depth: int) -> float:
        """The chance the target accepts the depth-th drafted token once it accepted those before it: measured at
        that depth, and where few were judged there, the depth above's (the first depth's: PRIOR_ACCEPTANCE)."""
        rate = PRIOR_ACCEPTANCE
        for d in range(1, depth + 1):
            rate = self.by_depth.rate(d, rate)
        return rate

    def worth(self, probability: float) -> float:
        """The chance the target accepts a token the draft gave this probability, as this answer's verdicts say."""
        b = bisect_right(EDGES, probability)
        return self.by_probability.rate(b, MIDDLES[b])

    def cost(self, forwards: float, n: int) -> float:
        """A round of `forwards` draft forwards and n drafted tokens, in target steps."""
        return forwards * self.draft + self.costs.verify(n + 1)

    def forecast_worths(self, n: int) -> list[float]:
        """The chance, before the round, that the target accepts each of n drafted tokens and all before it."""
        out, path = [], 1.0
        for depth in range(1, n + 1):
            path *= self.forecast(depth)
            out.append(path)
        return out

    def curve(self, k: int) -> list[float]:
        """Expected tokens per unit time, relative to plain decoding, of drafting n = 0..k tokens (one forward each),
        as forecast before the round."""
        if self.costs is None:
            return []
        worths = self.forecast_worths(k)
        return [self.gain(worths[:n], n) for n in range(k + 1)]

    def plan(self, k: int) -> tuple[int, list[float]]:
        """How many tokens this round may draft (0: a plain step; the first best on the curve), and the curve."""
        curve = self.curve(k)
        return (max(range(len(curve)), key=lambda n: (curve[n], -n)), curve) if curve else (k, curve)

    def go_on(self, worths: list[float], forwards: int) -> bool:
        """Whether to draw one more token after a round's tokens so far, whose path worths (the chance the target
        accepts each one and all before it) are `worths`: yes where its forecast worth raises the expected tokens
        per unit time, counting one more draft forward and one more row in the pass."""
        if self.costs is None:
            return True
        tokens, n = 1.0 + sum(worths), len(worths)
        more = worths[-1] * self.forecast(n + 1)
        return (tokens + more) / self.cost(forwards + 1, n + 1) > tokens / self.cost(forwards, n)

    def gain(self, worths: list[float], forwards: int) -> float:
        """The round's expected tokens per unit time, as drafted, relative to plain decoding."""
        if self.costs is None:
            return 0.0
        return (1.0 + sum(worths)) / self.cost(forwards, len(worths)) * self.cost(0, 0)

    def learn(self, verdicts: list[tuple[int, float, bool]]) -> None:
        """A round's verdicts: (depth, draft probability, accepted) of each token the target judged first at its
        depth. Earlier rounds' count less from now on."""
        self.by_depth.fade()
        self.by_probability.fade()
        for depth, probability, accepted in verdicts:
            self.by_depth.add(depth, accepted)
            self.by_probability.add(bisect_right(EDGES, probability), accepted)
