"""Drafters: anything that proposes the next k tokens. The target verifies all of them, so a
drafter only changes speed (how many are accepted), never the output distribution.

Interface (three methods):
  start(ids)                      prefill with the prompt
  propose(ids, k, cfg, generator) -> Draft: up to k tokens, and the distributions q they were
                                   sampled from (None for a deterministic drafter: q is a point mass);
                                   on a GPU the tokens stay on the device, and so may the draft's length;
                                   the draft is a tree (Draft.parents), a chain unless cfg.tree_nodes asks for more
  commit(ids)                     the round committed tokens; `ids` is the whole sequence now
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from .cache import CachedModel, TreeInput
from .config import MAX_GUESS
from .events import chain
from .messages import Refusal
from .sampling import sample, warp
from .theory import PassCosts, tree_size
from .timing import tree_costs
from .transfer import Transfer, upload

TREE_WIDTH = 4  # a tree node's children


@dataclass
class Draft:
    tokens: torch.Tensor  # [k'] proposed ids, k' <= k
    q: torch.Tensor | None  # [k', V] distributions they were sampled from; None = deterministic drafter
    logits: torch.Tensor | None = None  # [k', V] raw draft logits, kept only for display (cfg.record_top)
    size: torch.Tensor | None = None  # () on the device: only the first `size` tokens are the draft (None: all)
    failed: torch.Tensor | None = None  # () bool on the device: the draft produced NaN or +inf logits
    parents: list[int] = None  # each node's parent (-1: the last committed token); a chain's by default
    expected: float = 0.0  # the draft's own estimate of the tokens the target will accept
    steps: int = 0  # the draft's forwards (a model's; fewer than its tokens where guesses or a tree's levels saved some)

    def __post_init__(self):
        if self.parents is None:
            self.parents = chain(len(self))

    def __len__(self) -> int:
        return self.tokens.numel()


def without(q: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """q with `tokens` removed and renormalised: the distribution of a draw made after them without replacement."""
    if not tokens:
        return q
    q = q.index_fill(0, upload(tokens, q.device, torch.long), 0.0)
    return q / q.sum()


class Node(NamedTuple):
    """A drafted tree node."""
    token: int
    parent: int  # the parent's index among the nodes (-1: the last committed token)
    rank: float  # path probability under the draft, the j-th child counted at its parent's j-th largest probability
    q_row: int  # the row of the distribution it was drawn from (its parent's)
    sibling: int  # its place among its siblings, in the order drawn
    chain: bool  # on the chain: every node on its path a first child


class Fed(NamedTuple):
    """The nodes a round fed to the draft's cache, from `start` on: their tokens, and each one's parent's slot
    among them (-1: the last committed token)."""
    start: int
    tokens: list[int]
    parents: list[int]


def children(q: torch.Tensor, logits: torch.Tensor, width: int, cfg, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `width` children [rows, width], and the probabilities that rank them: the j-th child is ranked
    at its row's j-th largest probability (under q; greedy, whose q is one-hot: under the draft's softmax)."""
    ranked = torch.softmax(logits.float(), -1) if cfg.greedy else q
    top, picks = torch.topk(ranked, width, -1)
    if width == 1:  # a chain: the argmax, or one draw from q
        picks = q.argmax(-1, keepdim=True) if cfg.greedy else sample(q, generator)[..., None]
    elif not cfg.greedy:  # Gumbel top-k: `width` draws without replacement, in the order drawn
        u = torch.rand(q.shape, generator=generator, device=q.device).clamp_(min=1e-20)
        picks = torch.topk(torch.where(q > 0, q.log() - (-u.log()).log(), float("-inf")), width, -1).indices
    return top, picks


@dataclass
class Grown:
    """A draft as it grows: its nodes, the distributions (q, and the raw logits) of the rows they were drawn from,
    whether a row failed, and the nodes fed to the draft (by index)."""
    nodes: list[Node] = field(default_factory=list)
    qs: list[torch.Tensor] = field(default_factory=list)
    raw: list[torch.Tensor] = field(default_factory=list)
    failed: list[torch.Tensor] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)

    def add_level(self, frontier: list[int], top: torch.Tensor, picks: torch.Tensor) -> list[int]:
        """The children [len(frontier), width] drawn at the last rows, read in one transfer, as nodes: their indices."""
        level_read = Transfer()
        level_read.put("tops", top, floats=True)
        level_read.put("tokens", picks)
        tops, tokens = level_read.read().values()
        level, first_row = [], len(self.qs) - len(frontier)
        for f, parent in enumerate(frontier):
            above, on_chain = (1.0, True) if parent < 0 else (self.nodes[parent].rank, self.nodes[parent].chain)
            for j, (token, prob) in enumerate(zip(tokens[f], tops[f])):
                if prob <= 0:  # the distribution has fewer tokens than `width`
                    break
                self.nodes.append(Node(token, parent, above * prob, first_row + f, j, on_chain and j == 0))
                level.append(len(self.nodes) - 1)
        return level


class NoDrafter:
    """Proposes nothing: every round is one plain target step. This is autoregressive decoding."""

    name = "none"

    def start(self, ids):
        pass

    def propose(self, ids, k, cfg, generator):
        return Draft(torch.empty(0, dtype=torch.long), None)

    def commit(self, ids):
        pass


class ModelDrafter:
    """A small causal LM drafts k tokens autoregressively, sampling each from warped q.

    The confidence cut (cfg.min_confidence) stops a draft once the product of the draft's top
    probabilities falls below the threshold. A CPU reads each step's confidence and stops there: the
    read costs nothing and the steps saved are slow. A GPU must not wait for the host between steps,
    so it drafts all k and the cut becomes the draft's `size`, a number that stays on the device.
    """

    name = "model"

    def __init__(self, lm: CachedModel, cut_on_device: bool | None = None, width: int = TREE_WIDTH,
                 expand: int | None = None, pass_cost: PassCosts | None = None):
        self.lm = lm
        self.ngrams = Ngrams(most=MAX_GUESS, least=2)  # where a chain's last 2-3 tokens occurred before: its guesses
        self.cut_on_device = lm.device.type != "cpu" if cut_on_device is None else cut_on_device
        # a tree: children per node, nodes fed to the draft per level (two on CPUs), costs that size it
        self.width, self.pass_cost = width, pass_cost
        self.expand = (2 if lm.device.type == "cpu" else width) if expand is None else expand
        self.fed: Fed | None = None  # the drafted nodes fed to the cache in the last round
        self.forwards = 1  # draft forwards the last tree took: this round's sizing must not depend on its own draws
        self.guessed = 0  # nodes, over all drafts, whose distribution came with a guess (no forward of their own)

    def start(self, ids):
        self.lm.reset()
        self.lm.prefill(ids[:-1])
        self.fed = None

    def propose(self, ids, k, cfg, generator) -> Draft:
        """A tree up to k deep, grown a level at a time (EAGLE-2's scheme); a chain (cfg.tree_nodes = 0) is the
        tree whose nodes have one child each.

        Each expanded node offers its `width` likeliest children (greedy) or `width` children sampled without
        replacement (Gumbel top-k, in the order drawn); a chain's one child is the argmax or one draw from q. The
        first child of each is the chain's token; the chain goes as deep as k, cut where the product of its
        probabilities falls below cfg.min_confidence. A node's rank is its path probability under the draft, the
        j-th child counted at its parent's j-th largest probability. Each level feeds the draft, in one forward
        (a tree mask where it branches), the chain's node and the `expand` - 1 best others whose rank is still at
        least cfg.min_confidence (on a CPU, where each token of a forward costs more, `expand` is 2: one branch
        grows beside the chain; the rest are leaves, drawn from distributions the chain computes anyway).
        A tree keeps the chain, then the best alternatives: n nodes are worth 1 + (the sum of their ranks) expected
        tokens (the draft's own estimate) for a target pass of n + 1 tokens, whose cost `pass_cost` says, and nodes
        are added in that order while the worth per cost rises (theory.tree_size; the draft forwards are counted as
        the previous tree took). No node ranks above its parent or an earlier sibling, so what is kept is a tree
        whose siblings are the first ones drawn, as verify.decide requires; and neither a node's rank nor the ranks
        before it depend on the token drawn there or below, so sampled nodes are kept without bias.
        Each level's choices are read on the host in one transfer; a chain cut on the device reads nothing.
        Where a level feeds the chain's node alone, its forward carries up to cfg.guess guesses of the nodes below
        it (`feed`).
        """
        if not k:
            return Draft(torch.empty(0, dtype=torch.long, device=self.lm.device), None)
        width = min(self.width, self.lm.vocab) if cfg.tree_nodes else 1
        if self.cut_on_device and width == 1:
            return self.device_chain(ids, k, cfg, generator)
        return self.grow(ids, k, width, cfg, generator)

    def draw(self, g: Grown, logits: torch.Tensor, width: int, cfg, generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The children of the rows `logits` (theirs: `children`), their distributions kept in `g`."""
        q, bad = warp(logits, cfg.temperature, cfg.top_k, cfg.top_p)
        g.qs += q.unbind(0)
        g.raw += logits.unbind(0)
        g.failed.append(bad)
        return children(q, logits, width, cfg, generator)

    def device_chain(self, ids, k, cfg, generator) -> Draft:
        """A GPU's chain: all k drafted without a read, its cut becoming the draft's size (device_cut)."""
        logits, _ = self.feed(ids[self.lm.length:], 1, ids, list(ids), 0)
        g, chosen = Grown(), []
        for depth in range(k):
            top, picks = self.draw(g, logits, 1, cfg, generator)
            chosen.append((top[0, 0], picks[0]))
            if depth + 1 < k:
                logits = self.lm.forward(picks[0], keep=1)
        return self.device_cut(chosen, g, cfg)

    def grow(self, ids, k, width, cfg, generator) -> Draft:
        """A chain (with its guesses; width 1) or a tree, a level a forward, each level read on the host."""
        start, limit = len(ids), cfg.tree_nodes or k
        path = list(ids)  # the committed tokens and the chain's so far
        logits, pending = self.feed(ids[self.lm.length:], 1, ids, path, min(cfg.guess, min(k, limit) - 1))
        g, frontier, forwards = Grown(), [-1], 1
        for depth in range(k):
            level = g.add_level(frontier, *self.draw(g, logits, width, cfg, generator))
            chain_node = next(i for i in level if g.nodes[i].chain)
            if depth + 1 >= min(k, limit) or g.nodes[chain_node].rank < cfg.min_confidence:
                break
            frontier = self.next_frontier(g, level, chain_node, cfg)
            path.append(g.nodes[chain_node].token)
            if pending and frontier == [chain_node] and pending[0][0] == path[-1]:  # guessed: already fed
                logits = pending.pop(0)[1][None]
                g.fed.append(chain_node)
                self.guessed += 1
                continue
            self.lm.crop(start + len(g.fed))  # the guesses that were wrong
            index = {node: j for j, node in enumerate(g.fed)}
            parents = [index.get(g.nodes[n].parent, -1) for n in g.fed + frontier]
            tree = None if parents == chain(len(parents)) else TreeInput(parents, fed=len(g.fed))
            more = min(cfg.guess, min(k, limit) - depth - 2) if tree is None else 0
            logits, pending = self.feed([g.nodes[i].token for i in frontier], len(frontier), ids, path, more, tree)
            g.fed += frontier
            forwards += 1
        draft = self.select(g, start, limit, cfg)
        self.forwards = draft.steps = forwards
        return draft

    def next_frontier(self, g: Grown, level: list[int], chain_node: int, cfg) -> list[int]:
        """The nodes fed next: the chain's, and the `expand` - 1 best others of the level whose rank is still at
        least cfg.min_confidence (they grow while the draft believes in them as much as a chain must to go on)."""
        nodes = g.nodes
        others = sorted((i for i in level if i != chain_node and nodes[i].rank >= cfg.min_confidence),
                        key=lambda i: (-nodes[i].rank, i))[: self.expand - 1]
        return sorted([chain_node, *others])  # parents before children, as TreeInput wants

    def feed(self, tokens: list[int], rows: int, ids: list[int], path: list[int], most: int,
             tree: TreeInput | None = None) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
        """Feed `tokens` to the draft and, behind the last one, up to `most` guesses: the tokens that followed, in
        the committed `ids`, the 2- or 3-gram that `path` (ids and the chain so far) ends with, as many as the
        n-gram is long. Returns the logits of the last `rows` tokens, and each guess with the logits after it. A
        forward of a few rows costs little more than one, and a guess the chain then draws needs no forward of its
        own; where it draws another token, the guesses are cropped (those behind the chain's last node, by
        commit). Either way a node is drawn from the draft's distribution after its own path, and verified
        against that q."""
        n, guesses = self.ngrams.after(ids, path, most) if most > 0 else (0, [])
        guesses = guesses[:n]
        logits = self.lm.forward(upload(tokens + guesses, self.lm.device), keep=rows + len(guesses), tree=tree)
        return logits[:rows], list(zip(guesses, logits[rows:]))

    def select(self, g: Grown, start: int, limit: int, cfg) -> Draft:
        """The nodes worth their rows in the target's pass (a chain: every node), as a draft; the fed ones are
        remembered for commit."""
        nodes = g.nodes
        # the chain first, then the others best first: every prefix is a tree (parents, earlier siblings come first)
        order = sorted(range(len(nodes)), key=lambda i: (not nodes[i].chain, -nodes[i].rank, i))[:limit]
        n = tree_size([nodes[i].rank for i in order], self.pass_cost if cfg.tree_nodes else None, self.forwards)
        keep = sorted(order[:n])
        slot = {node: j for j, node in enumerate(g.fed)}  # where each fed node sits in the cache, after `start`
        self.fed = Fed(start, [nodes[i].token for i in g.fed], [slot.get(nodes[i].parent, -1) for i in g.fed])
        if not keep:  # no node pays for its row: a plain step
            return Draft(torch.empty(0, dtype=torch.long, device=self.lm.device), None)
        renumber = {old: new for new, old in enumerate(keep)}
        q = None
        if not cfg.greedy:  # each node's q: its parent's, without the siblings drawn before it, renormalised
            earlier = lambda node: [m.token for m in nodes if m.q_row == node.q_row and m.sibling < node.sibling]
            q = torch.stack([without(g.qs[nodes[i].q_row], earlier(nodes[i])) for i in keep])
        shown = torch.stack([g.raw[nodes[i].q_row] for i in keep]) if cfg.record_top else None  # the inspector's
        return Draft(upload([nodes[i].token for i in keep], self.lm.device, torch.long), q, shown, None,
                     torch.stack(g.failed).any(), [renumber.get(nodes[i].parent, -1) for i in keep],
                     sum(nodes[i].rank for i in keep))

    def device_cut(self, chosen, g: Grown, cfg) -> Draft:
        """A chain drafted without a read: it is cut where the product of its top probabilities falls below
        cfg.min_confidence, a length that stays on the device."""
        tops, tokens = zip(*chosen)
        size = None
        if cfg.min_confidence:
            dtype = torch.float32 if self.lm.device.type == "mps" else torch.float64
            sure = torch.stack(tops).to(dtype).cumprod(0)
            size = ((sure >= cfg.min_confidence).sum() + 1).clamp(max=len(tokens))
        return Draft(torch.cat(tokens), None if cfg.greedy else torch.stack(g.qs),
                     torch.stack(g.raw) if cfg.record_top else None, size, torch.stack(g.failed).any(), steps=len(tokens))

    def commit(self, ids):
        # keep only the committed prefix; the newest committed token is fed next round
        if self.fed:  # keep the fed nodes the committed tokens walk through (a chain's: a prefix, kept in place)
            start, tokens, parents = self.fed
            kept, at = [], -1
            for token in ids[start:]:
                at = next((j for j, (t, parent) in enumerate(zip(tokens, parents)) if parent == at and t == token), None)
                if at is None:
                    break
                kept.append(at)
            self.lm.compact(start, kept)
            self.fed = None
        self.lm.crop(len(ids) - 1)
        self.lm.check()


class Ngrams:
    """Where each n-gram of a growing sequence (n = least..most) last occurred with a token after it: prompt
    lookup's index. It is brought up to date with the tokens added since the last call, so a lookup costs the
    same at any length."""

    def __init__(self, most: int = 3, least: int = 1):
        self.most, self.least = most, least
        self.ids: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> where the token after its latest occurrence sits

    def after(self, ids: list[int], tail: list[int], most: int) -> tuple[int, list[int]]:
        """Up to `most` tokens of `ids` that followed the latest earlier occurrence of the longest n-gram ending
        `tail` (`ids` and what follows them), and that n; (0, []) where none occurred."""
        if ids[: len(self.ids)] != self.ids:  # not a continuation of the indexed sequence: index it afresh
            self.ids, self.last = [], {}
        for j in range(max(len(self.ids), 1), len(ids)):  # j: where the token after an n-gram sits
            for n in range(self.least, min(self.most, j) + 1):
                self.last[tuple(ids[j - n:j])] = j
        self.ids = list(ids)
        for n in range(min(self.most, len(tail)), self.least - 1, -1):
            j = self.last.get(tuple(tail[-n:]))
            if j is not None:
                return n, ids[j:j + most]
        return 0, []


class PromptLookupDrafter:
    """No model: find the latest earlier occurrence of the last n tokens (n = 3, else 2) and propose what followed.

    Nearly free, and strong whenever the output copies from the prompt (editing, extraction). A match of one token
    is mostly a common token's latest continuation (after a comma, a space), and wrong: on a CPU, a wrong 16-token
    proposal costs a 17-row pass, about 2.5 steps, for one token (docs/benchmarks.md#prompt-lookup).
    """

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        self.ngrams = Ngrams(max_ngram, min_ngram)

    def start(self, ids):
        pass

    def propose(self, ids, k, cfg, generator):
        return Draft(torch.tensor(self.ngrams.after(ids, ids, k)[1], dtype=torch.long), None)

    def commit(self, ids):
        pass


class HybridDrafter:
    """Prompt lookup when the text is being copied (a full k-token continuation of an earlier
    n-gram), the draft model otherwise. A copied round costs no draft steps at all; the model's
    cache catches up on the tokens it skipped the next time it drafts. A copy that the target
    mostly rejects (the text changes where it was copied from, as in a rename) sends the next
    `pause` rounds to the model."""

    name = "hybrid"

    def __init__(self, model: ModelDrafter, min_ngram: int = 3, pause: int = 2):
        self.model, self.lookup = model, PromptLookupDrafter(max_ngram=min_ngram, min_ngram=min_ngram)
        self.pause, self.paused, self.copied = pause, 0, None  # copied: (sequence length, k) of the last copy

    def start(self, ids):
        self.model.start(ids)
        self.paused, self.copied = 0, None

    def propose(self, ids, k, cfg, generator):
        if self.paused:
            self.paused -= 1
        else:
            copied = self.lookup.propose(ids, k, cfg, generator)
            if len(copied) == k:
                self.copied = (len(ids), k)
                return copied
        return self.model.propose(ids, k, cfg, generator)

    def commit(self, ids):
        if self.copied:
            length, k = self.copied
            if len(ids) - length - 1 < k / 2:  # fewer than half of the copied tokens accepted
                self.paused = self.pause
            self.copied = None
        self.model.commit(ids)


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


DRAFTERS = ("model", "hybrid", "prompt-lookup", "early-exit")  # by name; the first is the default


def make_drafter(pair, name: str = DRAFTERS[0], cfg=None):
    """By name: "model" (the pair's draft), "prompt-lookup" (n-grams), "hybrid" (n-grams when text is copied,
    else the draft), "early-exit" (the target's first quarter of layers). When `cfg` asks for token trees, they
    are sized by this device's pass costs (timing.tree_costs: timed once per pair)."""
    costs = tree_costs(pair) if cfg is not None and cfg.tree_nodes and name != "prompt-lookup" else None
    if name in ("model", "hybrid"):
        if pair.draft is None:
            raise Refusal("no_draft", pair=repr(pair.name))
        drafter = ModelDrafter(pair.cached("draft"), pass_cost=costs)
        return drafter if name == "model" else HybridDrafter(drafter)
    if name == "prompt-lookup":
        return PromptLookupDrafter()
    if name == "early-exit":
        layers = max(1, len(pair.target.get_decoder().layers) // 4)
        return EarlyExitDrafter(pair.target, pair.vocab, layers, pass_cost=costs)
    raise Refusal("drafter_unknown", value=repr(name))
