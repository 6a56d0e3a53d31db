"""What the engine yields (one RoundEvent per round) and the statistics derived from them.

Every field is plain Python so an event stream serialises to JSON as is (traces, the API).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

Top = list[tuple[int, float]]  # (token id, probability), most likely first


def chain(n: int) -> list[int]:
    """The parents of a chain of n drafted tokens: a tree with one branch."""
    return list(range(-1, n - 1))


def tree_depths(parents: list[int]) -> list[int]:
    """Each node's depth in a tree given as parents (parents first; -1: the root): 1 for the root's children."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


@dataclass
class RoundEvent:
    method: str  # "speculative" | "autoregressive"
    drafter: str  # which drafter proposed ("none" for autoregressive decoding)
    round: int  # 1-based
    k: int  # draft length asked for this round
    drafted: list[int]  # what the drafter proposed
    accepted: int  # length of the accepted prefix of `drafted`
    token: int  # the target's own token: replacement after a rejection, else bonus (or the AR step)
    token_kind: str  # "replacement" | "bonus" | "target" (autoregressive)
    committed: list[int]  # tokens appended this round (accepted prefix + token, cut at EOS / length)
    p_drafted: list[float]  # p(x_i): target probability of each drafted token (warped, as used)
    q_drafted: list[float]  # q(x_i): draft probability it was sampled with (1.0 for deterministic drafters)
    accept_probs: list[float]  # min(1, p/q) per drafted token
    uniforms: list[float]  # the uniform draw compared against it
    p_token: float  # probability of `token` under the distribution it was sampled from
    greedy: bool  # temperature 0: acceptance is argmax equality; tops below are softmax(logits)
    target_top: list[Top]  # per position (k'+1 rows): top target probabilities
    draft_top: list[Top]  # per drafted position: top draft probabilities ([] when deterministic)
    residual_top: Top | None  # after a rejection: top of the residual the token was sampled from
    prefill_s: float  # prompt prefill time (first round only)
    draft_s: float  # time drafting this round
    verify_s: float  # time of the target pass + verification
    overhead_s: float  # everything else in the round (commit, bookkeeping, event building)
    elapsed_s: float  # this decoder's own compute time since it started, at the end of this round
    n_generated: int  # tokens generated so far
    finished: bool = False
    finish_reason: str | None = None  # "eos" | "length"
    # the draft is a tree (a chain is one with one branch): `drafted` holds its nodes, parents first; p_drafted[i]
    # is p(x_i) as judged (after earlier siblings' rejections, their residual's); the rows of target_top are the
    # root's (0) and each node's (i + 1)
    parents: list[int] = field(default_factory=list)  # node i's parent (-1: the last committed token); chain(n)
    path: list[int] = field(default_factory=list)  # the accepted nodes, root to leaf; a chain's are its first `accepted`
    expected: float = 0.0  # the tokens the draft expected the target to accept (the sum of its path probabilities)
    draft_steps: int = 0  # the draft model's forwards this round (0: a drafter without a model, or a trace before them)
    # the draft model's policy (policy.py): before the round, the expected speedup of drafting n = 0..k tokens, as
    # forecast from this answer's acceptance; and that of the round as it drafted (a plain step's: of drafting)
    curve: list[float] = field(default_factory=list)
    gain: float = 0.0
    step_ms: float = 0.0  # the target's step, as the policy last timed it, that the round was priced against

    def depth_of(self, i: int) -> int:
        """Node i's depth: 1 for the first token after the committed text."""
        return tree_depths(self.parents)[i]

    @property
    def plain_step(self) -> bool:
        """A speculative round whose policy judged that drafting would not pay (not one with no room left to draft)."""
        return self.method == "speculative" and self.k > 0 and not self.drafted and bool(self.curve)

    @property
    def depth(self) -> int:
        """How deep the draft went: a chain's length, a tree's deepest node."""
        return max(tree_depths(self.parents), default=0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RoundEvent":
        """The inverse of to_dict, also after a trip through JSON (which turns tuples into lists)."""
        pairs = lambda row: [tuple(x) for x in row]
        if d.get("parents") is None:  # a trace saved before chains were written as trees
            d = {**d, "parents": chain(len(d["drafted"])), "path": list(range(d["accepted"]))}
        d = {**d, "target_top": [pairs(r) for r in d["target_top"]], "draft_top": [pairs(r) for r in d["draft_top"]],
             "residual_top": pairs(d["residual_top"]) if d.get("residual_top") is not None else None}
        return cls(**d)


@dataclass
class Prefilling:
    """Between two chunks of a long prompt (the engine's `progress`): `model`'s cache holds `done` of the prompt's
    `total` tokens. A consumer that stops taking events here stops the prefill."""
    model: str  # "target" | "draft"
    done: int
    total: int
    elapsed_s: float  # this decoder's own compute time so far, as a RoundEvent's


@dataclass
class Stats:
    method: str
    drafter: str
    tokens: int = 0
    rounds: int = 0
    seconds: float = 0.0  # own compute time, prefill included
    prefill_s: float = 0.0
    tokens_per_s: float = 0.0  # end to end: prefill included
    decode_tokens_per_s: float = 0.0  # after the prefill: what the cost model predicts
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0  # alpha: P(a drafted token is accepted | every token before it was)
    accepted_fraction: float = 0.0  # accepted / drafted (tokens drafted after a rejection count as lost)
    mean_accepted_length: float = 0.0  # accepted draft tokens per round
    tokens_per_round: float = 0.0  # committed tokens per round (accepted + the target's token)
    accepted_length_histogram: list[int] = field(default_factory=list)  # rounds with 0, 1, ..., K accepted
    acceptance_by_position: list[float] = field(default_factory=list)  # P(accept | draft position i reached)
    draft_s: float = 0.0
    verify_s: float = 0.0
    overhead_s: float = 0.0
    plain_steps: int = 0  # speculative rounds that drafted nothing: the policy judged that drafting would not pay
    finish_reason: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(events: list[RoundEvent]) -> Stats:
    if not events:
        return Stats(method="", drafter="")
    s = Stats(method=events[0].method, drafter=events[0].drafter)
    max_k = max(max(len(e.drafted), e.depth) for e in events)
    hist, reached, acc = [0] * (max_k + 1), [0] * max_k, [0] * max_k  # per draft position
    for e in events:
        hist[e.accepted] += 1
        for i in range(min(e.accepted + 1, e.depth)):  # positions (a tree's depths) the target actually judged
            reached[i] += 1
            acc[i] += i < e.accepted
        s.drafted += len(e.drafted)
        s.accepted += e.accepted
        s.tokens += len(e.committed)
        s.prefill_s += e.prefill_s
        s.draft_s += e.draft_s
        s.verify_s += e.verify_s
        s.overhead_s += e.overhead_s
        s.plain_steps += e.plain_step
    s.rounds = len(events)
    s.seconds = events[-1].elapsed_s
    s.tokens_per_s = s.tokens / s.seconds if s.seconds > 0 else 0.0
    s.decode_tokens_per_s = s.tokens / (s.seconds - s.prefill_s) if s.seconds > s.prefill_s else 0.0
    s.acceptance_rate = s.accepted / sum(reached) if sum(reached) else 0.0
    s.accepted_fraction = s.accepted / s.drafted if s.drafted else 0.0
    s.mean_accepted_length = s.accepted / s.rounds
    s.tokens_per_round = s.tokens / s.rounds
    s.accepted_length_histogram = hist
    s.acceptance_by_position = [a / r if r else 0.0 for a, r in zip(acc, reached)]
    s.finish_reason = events[-1].finish_reason
    return s


@dataclass
class Result:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    stats: Stats
    events: list[RoundEvent]
