"""How far a round drafts: only as far as the measured costs say it pays, 0 (a plain step) included.

A round of n drafted tokens costs the draft's forwards and a target pass of n + 1 rows (`PassCosts.verify`), in target
steps, and brings 1 + the sum of its tokens' worths (the chance the target accepts every token up to each). Plain
decoding brings 1 token a step. From this answer's own rounds, the latest weighted most, the policy learns:
  - the acceptance by depth (`forecasts`), which gives the `curve` of expected speedup against n before a round;
  - a drawn token's worth, its draft probability calibrated by verdicts on like probabilities (`worth`), and the next
    token's chance after one of that probability (`next_rate`);
  - the draft's costs from its rounds' times (first token, later forwards, guesses that needed none), and the
    target's from its passes as the rounds take them (`passed`): the step's from plain steps and passes of two rows,
    which read the weights as a step does, and larger passes' from theirs, whose arithmetic shows. Each is the fastest
    of the latest rounds, since other work on the machine only ever adds time.
Within a round the chain goes on while the next token raises the expected tokens per unit time (`go_on`). Before it,
a CPU's drafter drafts only where such a round pays on average (`plan`), else takes a plain step; a GPU's chain drafts
the curve's best length. Trees keep nodes by the same rule (theory.tree_size). The policy reads earlier rounds'
verdicts and the draft's own draws, never this round's verification, as exact verification needs (verify.py).
"""
from __future__ import annotations

from bisect import bisect_right
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field

from .config import MAX_TREE_NODES
from .theory import PassCosts

DECAY = 0.95  # each round, every earlier verdict counts this much less: an answer's text changes as it goes
PRIOR_WEIGHT = 2.0  # verdicts' worth of belief before any: the draft's own probability, or the depth above's rate
PRIOR_ACCEPTANCE = 0.8
RECENT = 8  # the latest rounds whose fastest times are the draft's and the target's costs: a burst of other work
# (a browser drawing each update) slows the rounds it lands on, and an average of those would price drafting out,
# after which plain steps time no draft to bring it back
GUESS_WEIGHT = 0.2  # how far each round moves the share of later tokens that came with a guess
EDGES = (0.3, 0.5, 0.7, 0.85, 0.95)  # a token's draft probability, binned for calibration
MIDDLES = (0.15, 0.4, 0.6, 0.78, 0.9, 0.98)  # each bin's prior: what the draft itself believes
FIRSTS, FIRSTS_NEEDED = 32, 4  # the latest first tokens' probabilities that price a round before its first draw
EXPLORE = 0.02  # after plain steps, a round drafts again once their count times this reaches what drafting was
# expected to lose: a probe costs about that shortfall, so probing keeps the loss near this share of a step, and the
# verdicts it brings let drafting come back where the text has changed. A probe also feeds the draft every token
# committed since it last drafted, a cost the shortfall leaves out: each probe after which drafting still does not
# pay doubles the wait for the next (MISSES at most), so that an answer drafting does not suit pays for a few probes
MISSES = 4


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
        # acceptance by depth, by the token's draft probability, and after a token of like probability was accepted
        self.by_depth, self.by_probability, self.after = Verdicts(), Verdicts(), Verdicts()
        self.firsts: deque[float] = deque(maxlen=FIRSTS)  # the draft probabilities of the latest first tokens
        # a draft's costs in target steps, as measured: its first token (the forward that takes the committed tokens,
        # the draw, the read), each forward after it, and the share of later tokens that came without a forward
        self.first = self.next = costs.draft if costs is not None else 0.0
        self.guessing = 0.0
        # the target's step as its plain steps and two-token passes now take, which the other costs are measured against:
        # a shared machine's speed changes, and costs timed once would call the draft and the passes dearer or cheaper
        self.step_s = costs.step_ms / 1000 if costs is not None and costs.step_ms else 0.0
        # a pass of n tokens in steps (as timed at load until the rounds price it: `price`), and as timed at load in
        # seconds, what the latest passes of more than two tokens are priced against
        self.verify = [self.costs.verify(n) for n in range(MAX_TREE_NODES + 2)] if self.costs else []
        self.timed = [cost * self.step_s for cost in self.verify]
        # the latest times of each, in seconds (passes of more than two tokens: their ratio to their timed cost), the
        # costs timed at load among them until RECENT rounds have come
        self.times = {"first": deque([self.first * self.step_s], maxlen=RECENT),
                      "next": deque([self.next * self.step_s], maxlen=RECENT), "step": deque([self.step_s], maxlen=RECENT),
                      "rows": deque([1.0], maxlen=RECENT)}
        self.plain_run = 0  # plain steps since the last round that drafted
        self.misses, self.probed = 0, False  # probes in a row that drafting did not follow; the last round one

    def observe(self, first_s: float, rest_s: float, forwards: int, tokens: int) -> None:
        """A round's draft took `first_s` to its first token and `rest_s` for the rest, in `forwards` forwards for
        `tokens` tokens, all included (sampling, reads): where the target's step was timed, these times join the latest
        that price the draft (`price`)."""
        if self.costs is None or not self.step_s or not tokens:
            return
        self.times["first"].append(first_s)
        if forwards > 1:
            self.times["next"].append(rest_s / (forwards - 1))
        if tokens > 1:
            self.guessing += GUESS_WEIGHT * (1 - (forwards - 1) / (tokens - 1) - self.guessing)
        self.price()

    def passed(self, seconds: float, rows: int) -> None:
        """A round's target pass of `rows` rows took `seconds`, its decision and read included. A step reads every
        weight once, and so does a pass of two rows, whose second row's arithmetic hides under the reading: either
        says what a step takes now. A larger pass's arithmetic shows, and says what such passes take now against their
        timed cost: other work on the machine slows the reading and the arithmetic apart."""
        if self.costs is not None and self.step_s and 1 <= rows < len(self.verify):
            if rows <= 2:
                self.times["step"].append(seconds / self.verify[rows])
            else:
                self.times["rows"].append(seconds / self.timed[rows])
            self.price()

    def price(self) -> None:
        """The costs from the fastest of the latest times of each kind: a pass of more than two tokens costs its timed
        cost times the latest such passes' ratio to it, in steps as the latest take, and never less than two tokens'."""
        self.step_s, rows = min(self.times["step"]), min(self.times["rows"])
        self.first, self.next = min(self.times["first"]) / self.step_s, min(self.times["next"]) / self.step_s
        self.verify[3:] = [max(self.verify[2], rows * t / self.step_s) for t in self.timed[3:]]

    def forecasts(self, depth: int) -> list[float]:
        """The chance that the target accepts the d-th drafted token once it accepted those before it, d = 1..depth:
        measured at that depth, and where few were judged there, the depth above's (the first's: PRIOR_ACCEPTANCE)."""
        out, rate = [], PRIOR_ACCEPTANCE
        for d in range(1, depth + 1):
            rate = self.by_depth.rate(d, rate)
            out.append(rate)
        return out

    def worth(self, probability: float) -> float:
        """The chance the target accepts a token the draft gave this probability, as this answer's verdicts say."""
        b = bisect_right(EDGES, probability)
        return self.by_probability.rate(b, MIDDLES[b])

    def next_rate(self, probability: float, depth: int) -> float:
        """The chance that the target accepts the token at `depth` once it accepted the one before it, drawn at
        `probability`: measured after tokens of like probability (a draft sure of one token tends to be sure of the
        next), and where few were judged there, the depth's forecast."""
        return self.after.rate(bisect_right(EDGES, probability), self.forecasts(depth)[depth - 1])

    def cost(self, n: int, free: int = 0) -> float:
        """A round of n drafted tokens, in target steps: the first token, and each later one a forward unless it came
        with a guess (as often as they have lately); `free` of them known to need none."""
        later = (n - 1 - free) * self.next * (1 - self.guessing) if n else 0.0
        return (self.first if n else 0.0) + later + self.verify[n + 1]

    def gain(self, worths: list[float]) -> float:
        """A round's expected tokens per unit time, relative to plain decoding, for drafted tokens of these worths."""
        if self.costs is None:
            return 0.0
        return (1.0 + sum(worths)) / self.cost(len(worths)) * self.cost(0)

    def curve(self, k: int) -> list[float]:
        """Expected tokens per unit time, relative to plain decoding, of drafting n = 0..k tokens, as forecast
        before the round."""
        if self.costs is None:
            return []
        worths, path = [], 1.0
        for rate in self.forecasts(k):
            path *= rate
            worths.append(path)
        return [self.gain(worths[:n]) for n in range(k + 1)]

    def go_on(self, worths: list[float], rate: float, guessed: bool = False) -> bool:
        """Whether to draw one more token after a round's tokens so far, whose worths are `worths`, the next one
        accepted at `rate` once they were (`next_rate`): yes where its worth raises the expected tokens per unit time,
        for a row in the pass and a token's draft cost (none where the draft drew the token its last forward had
        guessed: `guessed`). The costs are convex and the worths fall, so the first token that does not pay ends the
        round's best."""
        if self.costs is None:
            return True
        n, tokens = len(worths), 1.0 + sum(worths)
        return (tokens + worths[-1] * rate) / self.cost(n + 1, int(guessed)) > tokens / self.cost(n)

    def drafting(self, k: int) -> float:
        """The expected tokens per unit time, relative to plain decoding, of a round that drafts and goes on by
        `go_on`, its first token as probable as one of the latest first tokens, each one after at the forecast."""
        rates, tokens, cost = self.forecasts(k), 0.0, 0.0
        for first, count in Counter(self.worth(p) for p in self.firsts).items():
            worths = [first]
            while len(worths) < k and self.go_on(worths, rates[len(worths)]):
                worths.append(worths[-1] * rates[len(worths)])
            tokens += count * (1.0 + sum(worths))
            cost += count * self.cost(len(worths))
        return tokens / cost * self.cost(0)

    def plan(self, k: int, reads: bool = True) -> tuple[int, list[float], float]:
        """Before a round: how many tokens it may draft (0: a plain step), the curve, and what drafting is expected
        to bring (for a plain step, what it would have). With `reads` and enough first tokens seen, a round that
        drafts may go to k (go_on stops it); else it drafts the curve's first best length. Where drafting is expected
        to bring less than a plain step, the round is one, unless enough plain steps came before (EXPLORE, doubled
        by each probe in a row that drafting did not follow)."""
        curve = self.curve(k)
        if not curve or not k:  # no costs: as far as asked; nothing asked: nothing
            return k, curve, 0.0
        if reads and len(self.firsts) >= FIRSTS_NEEDED:
            n, value = k, self.drafting(k)
        else:
            n = max(range(1, k + 1), key=lambda j: (curve[j], -j))
            value = curve[n]
        if value > curve[0]:
            self.misses, self.probed = 0, False
        else:
            self.misses, self.probed = min(self.misses + self.probed, MISSES), False
            if self.plain_run * EXPLORE < (curve[0] - value) * 2 ** self.misses:
                self.plain_run += 1
                return 0, curve, value
            self.probed = True
        self.plain_run = 0
        return n, curve, value

    def learn(self, verdicts: list[tuple[int, float, bool]]) -> None:
        """A round's verdicts: (depth, draft probability, accepted) of each token the target judged first at its
        depth. Earlier rounds' count less from now on."""
        for kind in (self.by_depth, self.by_probability, self.after):
            kind.fade()
        before = None  # the draft probability of the first child at the depth above, where the target accepted it
        for depth, probability, accepted in verdicts:
            self.by_depth.add(depth, accepted)
            self.by_probability.add(bisect_right(EDGES, probability), accepted)
            if depth == 1:
                self.firsts.append(probability)
            elif before is not None:
                self.after.add(bisect_right(EDGES, before), accepted)
            before = probability if accepted else None
