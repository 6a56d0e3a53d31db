"""Drafters propose the next k tokens; the target verifies all of them, so a drafter changes the speed, never the
output distribution. Two methods, and a round enters a drafter once:
  start(ids): prefill the prompt, an iterator yielding how many tokens are in after each chunk (a long prompt can
    be stopped between them);
  propose(ids, k, cfg, generator) -> Draft: up to k tokens (a chain, or a tree where cfg.tree_nodes asks) and the
    distributions q they were drawn from (None: a point mass). `ids` is the whole sequence: what the rounds since
    the last draft committed is read from it first. On a GPU the tokens stay on the device.
"""
from __future__ import annotations

import copy
import time
from dataclasses import replace

import torch
from torch import nn

from .cache import CachedModel, TreeInput
from .config import MAX_GUESS
from .drafts import CachedNodes, Draft
from .events import chain
from .lookup import HybridDrafter, Ngrams, PromptLookupDrafter
from .messages import Refusal
from .policy import Policy
from .sampling import children, warp, without
from .theory import PassCosts
from .transfer import upload
from .trees import GrowingDraft, Node, verdicts

TREE_WIDTH = 4  # a tree node's children
# Qwen2's vocabulary from this id to its special tokens: mostly scripts other than Latin (CJK, Arabic, Cyrillic,
# Hangul, Hebrew, Thai), a third of the draft head's rows (rare_tokens; docs/benchmarks.md has what leaving them out gave)
QWEN2_RARE_FROM, QWEN2_SPECIALS = 98304, 151643


class DraftCache:
    """The draft's cache as drafting uses it: the committed tokens fed, then a round's nodes (`fed`), with the guesses
    behind a chain's last node; after the verdict, the fed nodes the committed tokens walk through kept in place, the
    rest dropped."""

    def __init__(self, lm: CachedModel):
        self.lm = lm
        self.ngrams = Ngrams(most=MAX_GUESS, least=2)  # where a chain's last 2-3 tokens occurred before: its guesses
        self.fed: CachedNodes | None = None  # the drafted nodes fed to the cache in the last round

    def start(self, ids):
        self.fed = None
        self.lm.reset()
        yield from self.lm.prefill_chunks(ids[:-1])

    def feed(self, tokens: list[int], rows: int, ids: list[int], path: list[int], most: int,
             tree: TreeInput | None = None) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
        """Feed `tokens` and, behind them, up to `most` guesses: what followed the 2- or 3-gram that `path` ends with
        in the committed `ids`. Returns the last `rows` tokens' logits and each guess with the logits after it. A
        few rows cost about one, and a guess the chain then draws needs no forward of its own; wrong guesses are
        cropped. Every node is still drawn from the draft's q after its own path."""
        n, guesses = self.ngrams.after(ids, path, most) if most > 0 else (0, [])
        guesses = guesses[:n]
        logits = self.lm.forward(upload(tokens + guesses, self.lm.device), keep=rows + len(guesses), tree=tree)
        return logits[:rows], list(zip(guesses, logits[rows:]))

    def commit(self, ids):
        """Keep only the committed prefix; the newest committed token is fed next round."""
        if self.fed:  # keep the fed nodes the committed tokens walk through (a chain's: a prefix, kept in place)
            start, tokens, parents = self.fed
            kept, at = [], -1
            for token in ids[start:]:
                at = next((j for j, (t, up) in enumerate(zip(tokens, parents)) if up == at and t == token), None)
                if at is None:
                    break
                kept.append(at)
            self.lm.compact(start, kept)
            self.fed = None
        self.lm.crop(len(ids) - 1)
        self.lm.check()


class ModelDrafter:
    """A small causal LM drafts tokens one forward at a time, each drawn from its warped q, as far as the policy says
    (policy.Policy). A CPU reads each level on the host and decides there; a GPU, which must not wait for the host,
    drafts the policy's forecast length and verifies it all."""

    name = "model"

    def __init__(self, lm: CachedModel, cut_on_device: bool | None = None, width: int = TREE_WIDTH,
                 expand: int | None = None, pass_cost: PassCosts | None = None, rare: tuple[int, int] | None = None):
        self.cache = DraftCache(lm)
        self.rare, self.watched = rare, 0  # token ids the head leaves out until the text holds one; ids looked at
        self.cut_on_device = lm.device.type != "cpu" if cut_on_device is None else cut_on_device
        # a tree: children per node, nodes fed to the draft per level (two on CPUs); the costs that size every draft
        self.width, self.pass_cost = width, pass_cost
        self.expand = (2 if lm.device.type == "cpu" else width) if expand is None else expand
        self.policy = Policy(pass_cost)
        self.forwards = 1  # draft forwards the last tree took: this round's sizing must not depend on its own draws
        self.guessed = 0  # nodes, over all drafts, whose distribution came with a guess (no forward of their own)
        self.first_at = self.grown_at = 0.0  # when the last draft's first token was drawn, and its last one
        # the last draft's start and nodes, judged when the next round settles; the last draft, which the engine
        # tells how long its verification took
        self.awaiting_verdicts: tuple[int, list[Node]] | None = None
        self.proposed: Draft | None = None

    @property
    def lm(self) -> CachedModel:
        return self.cache.lm

    def start(self, ids):
        self.awaiting_verdicts, self.proposed, self.policy = None, None, Policy(self.pass_cost)
        self.lm.skip, self.watched = self.rare, 0
        self.watch(ids)
        yield from self.cache.start(ids)

    def watch(self, ids) -> None:
        """The draft's steps leave the rare tokens out of its head (q = 0 there: the target still writes them, from
        its residual) until the prompt or the answer holds one; from then on this answer drafts over them all."""
        if self.lm.skip is not None:
            lo, hi = self.lm.skip
            if any(lo <= t < hi for t in ids[self.watched:]):
                self.lm.skip = None
        self.watched = len(ids)

    def propose(self, ids, k, cfg, generator) -> Draft:
        """A tree up to k deep, grown a level at a time (EAGLE-2's scheme); a chain is the tree of one child a node.

        Each expanded node offers its `width` likeliest children (greedy) or `width` drawn without replacement (Gumbel
        top-k, in the order drawn); the first child is the chain's. The chain goes on while the policy says the next
        token pays (Policy.go_on), up to k, and while its path probability stays at least cfg.min_confidence. A
        node's rank is its path probability (the j-th child at its parent's j-th largest probability); its worth,
        the chance the target accepts its path (Policy.worth). Each level feeds, in one forward, the chain's node and
        the `expand` - 1 best others (trees.GrowingDraft.frontier); a tree keeps nodes by rank while their worth per
        pass cost rises (trees.GrowingDraft.kept). No node ranks above its parent or an earlier sibling, and no rank
        or worth depends on the token drawn there or below: sampled trees are kept without bias (verify.decide).
        """
        self.settle(ids)
        width = min(self.width, self.lm.vocab) if cfg.tree_nodes else 1
        on_device = self.cut_on_device and width == 1
        n, curve, value = self.policy.plan(k, reads=not on_device)
        if not n:  # drafting does not pay: a plain step, with no draft forward
            draft = Draft(torch.empty(0, dtype=torch.long, device=self.lm.device), None, gain=value)
        elif on_device:  # the curve's length, its expected gain
            draft = self.device_chain(ids, n, cfg, generator)
            draft.gain = value
        else:  # read on the host level by level: its time is known without a wait, and the policy learns it where
            t0, behind = time.perf_counter(), len(ids) - self.lm.length  # the draft caught up as after a drafted round
            draft = self.grow(ids, k, width, cfg, generator)
            if behind <= 2:  # what the round took once, whatever its length, counted with its first token
                once = self.first_at - t0 + time.perf_counter() - self.grown_at
                self.policy.observe(once, self.grown_at - self.first_at, draft.forwards, len(draft))
        draft.curve, draft.step_ms = curve, self.policy.step_s * 1000
        self.proposed = draft
        return draft

    def draw(self, g: GrowingDraft, logits: torch.Tensor, width: int, cfg,
             generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The children of the rows `logits` (theirs: `children`), their distributions kept in `g`."""
        q, bad = warp(logits, cfg.temperature, cfg.top_k, cfg.top_p)
        g.qs += q.unbind(0)
        g.raw += logits.unbind(0)
        g.failed.append(bad)
        return children(q, logits, width, cfg, generator)

    def device_chain(self, ids, k, cfg, generator) -> Draft:
        """A GPU's chain: all k drafted without a read, and all verified."""
        logits, _ = self.cache.feed(ids[self.lm.length:], 1, ids, list(ids), 0)
        g, chosen = GrowingDraft(), []
        for depth in range(k):
            _, picks = self.draw(g, logits, 1, cfg, generator)
            chosen.append(picks[0])
            if depth + 1 < k:
                logits = self.lm.forward(picks[0], keep=1)
        return Draft(torch.cat(chosen), None if cfg.greedy else torch.stack(g.qs),
                     torch.stack(g.raw) if cfg.record_top else None, torch.stack(g.failed).any(), forwards=len(chosen))

    def grow(self, ids, k, width, cfg, generator) -> Draft:
        """A chain (with its guesses; width 1) or a tree, a level a forward, each level read on the host."""
        start, limit = len(ids), cfg.tree_nodes or k
        path = list(ids)  # the committed tokens and the chain's so far
        logits, pending = self.cache.feed(ids[self.lm.length:], 1, ids, path, min(cfg.guess, min(k, limit) - 1))
        g, frontier, forwards, worths = GrowingDraft(), [-1], 1, []
        for depth in range(k):
            level = g.add_level(frontier, *self.draw(g, logits, width, cfg, generator), self.policy.worth)
            self.first_at = time.perf_counter() if not depth else self.first_at  # the first token's cost ends here
            chain_node = next(i for i in level if g.nodes[i].chain)
            worths.append(g.nodes[chain_node].worth)
            frontier = g.frontier(level, chain_node, self.expand, cfg.min_confidence)
            guessed = bool(pending) and frontier == [chain_node] and pending[0][0] == g.nodes[chain_node].token
            if (depth + 1 >= min(k, limit) or g.nodes[chain_node].rank < cfg.min_confidence
                    or not self.policy.go_on(worths, self.policy.next_rate(g.nodes[chain_node].prob, depth + 2),
                                             guessed)):
                break
            path.append(g.nodes[chain_node].token)
            if guessed:  # the next level's distribution came with the last forward: no forward of its own
                logits = pending.pop(0)[1][None]
                g.fed.append(chain_node)
                self.guessed += 1
                continue
            self.lm.crop(start + len(g.fed))  # the guesses that were wrong
            index = {node: j for j, node in enumerate(g.fed)}
            parents = [index.get(g.nodes[n].parent, -1) for n in g.fed + frontier]
            tree = None if parents == chain(len(parents)) else TreeInput(parents, fed=len(g.fed))
            more = min(cfg.guess, min(k, limit) - depth - 2) if tree is None else 0
            logits, pending = self.cache.feed([g.nodes[i].token for i in frontier], len(frontier), ids, path, more,
                                              tree)
            g.fed += frontier
            forwards += 1
        self.grown_at = time.perf_counter()
        draft = self.select(g, start, limit, cfg)
        self.forwards = draft.forwards = forwards
        return draft

    def select(self, g: GrowingDraft, start: int, limit: int, cfg) -> Draft:
        """The nodes worth their rows in the target's pass (a chain: every node), as a draft, with the policy's
        expected gain; the fed ones are remembered for the cache, the kept ones for their verdicts (settle)."""
        nodes, keep = g.nodes, g.kept(limit, self.policy.costs if cfg.tree_nodes else None, self.forwards)
        slot = {node: j for j, node in enumerate(g.fed)}  # where each fed node sits in the cache, after `start`
        self.cache.fed = CachedNodes(start, [nodes[i].token for i in g.fed],
                                     [slot.get(nodes[i].parent, -1) for i in g.fed])
        renumber = {old: new for new, old in enumerate(keep)}
        self.awaiting_verdicts = (start, [nodes[i]._replace(parent=renumber.get(nodes[i].parent, -1)) for i in keep])
        tokens, expected = [nodes[i].token for i in keep], sum(nodes[i].rank for i in keep)
        gain = self.policy.gain([nodes[i].worth for i in keep])
        if not keep:  # no node pays for its row: a plain step
            return Draft(torch.empty(0, dtype=torch.long, device=self.lm.device), None, gain=gain)
        q = None
        if not cfg.greedy:  # each node's q: its parent's, without the siblings drawn before it, renormalised
            earlier = lambda node: [m.token for m in nodes if m.q_row == node.q_row and m.sibling < node.sibling]
            q = torch.stack([without(g.qs[nodes[i].q_row], earlier(nodes[i])) for i in keep])
        shown = torch.stack([g.raw[nodes[i].q_row] for i in keep]) if cfg.record_top else None  # the inspector's
        return Draft(upload(tokens, self.lm.device, torch.long), q, shown, torch.stack(g.failed).any(),
                     [renumber.get(nodes[i].parent, -1) for i in keep], expected, gain=gain)

    def settle(self, ids):
        """What the rounds since the last propose committed (`ids`, the whole sequence now): the last draft's
        verdicts and its pass's time for the policy, the draft's cache brought to the committed tokens, and whether
        its head still leaves the rare tokens out (watch)."""
        if self.proposed is not None and self.proposed.verified_s:
            self.policy.passed(self.proposed.verified_s, len(self.proposed) + 1)
        self.proposed = None
        self.policy.learn(verdicts(*self.awaiting_verdicts, ids) if self.awaiting_verdicts else [])
        self.awaiting_verdicts = None
        self.cache.commit(ids)
        self.watch(ids)


class EarlyExitDrafter(ModelDrafter):
    """Self-speculation: the target's first `layers` layers, its final norm and its head draft.

    The view shares every weight with the target, so no second model sits in memory.
    """

    name = "early-exit"

    def __init__(self, target, vocab: int, layers: int, pass_cost: PassCosts | None = None):
        super().__init__(CachedModel(truncated_view(target, layers), vocab), pass_cost=pass_cost)


def truncated_view(model: nn.Module, layers: int) -> nn.Module:
    """A shallow copy of a decoder-only HF model that runs only its first `layers` blocks."""
    inner = model.get_decoder()
    total = len(inner.layers)
    if not 1 <= layers < total:
        raise Refusal("early_exit_layers", total=total, value=layers)
    view_inner = copy.copy(inner)
    view_inner._modules = dict(inner._modules)  # own module table, shared modules
    view_inner.layers = nn.ModuleList(list(inner.layers)[:layers])
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view.config = copy.copy(model.config)
    view.config.num_hidden_layers = layers
    view_inner.config = view.config
    name = next(n for n, m in model.named_children() if m is inner)
    setattr(view, name, view_inner)
    return view


def rare_tokens(pair) -> tuple[int, int] | None:
    """The token ids a draft step's head may leave out, [lo, hi): Qwen2's rare ones (QWEN2_RARE_FROM) where the pair
    has its vocabulary; None for others, whose rare tokens nobody measured."""
    tok = pair.tokenizer
    if tok is None or tok.convert_tokens_to_ids("<|endoftext|>") != QWEN2_SPECIALS:
        return None
    return QWEN2_RARE_FROM, QWEN2_SPECIALS // 4 * 4  # int4 tiles hold 4 outputs a row


DRAFTERS = ("model", "hybrid", "prompt-lookup", "early-exit")  # by name; the first is the default


def times_passes(pair, name: str) -> bool:
    """Whether make_drafter(pair, name) times the pair's passes first (seconds, once per pair, Pair.costs): every
    drafter but prompt lookup, until they are timed."""
    return name != "prompt-lookup" and not pair.costs_known


def make_drafter(pair, name: str = DRAFTERS[0], cfg=None):
    """By name: "model" (the pair's draft), "prompt-lookup" (n-grams), "hybrid" (n-grams when text is copied,
    else the draft), "early-exit" (the target's first quarter of layers). A model's drafts go as far as this
    device's pass costs say they pay (Pair.costs: timed once per pair). `cfg` is not read: the drafter takes
    each round's settings as it proposes."""
    if name == "prompt-lookup":
        return PromptLookupDrafter()
    costs = pair.costs()
    if name in ("model", "hybrid"):
        if pair.draft is None:
            raise Refusal("no_draft", pair=repr(pair.name))
        drafter = ModelDrafter(pair.cached("draft"), pass_cost=costs, rare=rare_tokens(pair))
        return drafter if name == "model" else HybridDrafter(drafter)
    if name == "early-exit":  # its forward: a quarter of the target's layers
        total = len(pair.target.get_decoder().layers)
        layers = max(1, total // 4)
        return EarlyExitDrafter(pair.target, pair.vocab, layers, pass_cost=replace(costs, draft=layers / total))
    raise Refusal("drafter_unknown", value=repr(name))
