"""Verification: the accept/reject step of speculative sampling, as pure functions over tensors.

Naming, used everywhere in this project: **p is the target's distribution, q the draft's**
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding").
A drafted token x is accepted with probability min(1, p(x) / q(x)); at the first rejection the
replacement is sampled from the residual norm(max(0, p - q)); when all k are accepted a bonus
token is sampled from p at the position after them. The output then has exactly the target's
distribution, whatever q is, provided q is the distribution x was actually sampled from.

`decide` does all of it on the device, with no value read back to the host, so a GPU never waits
for the CPU in the middle of a round.

**Trees.** A draft is a tree, and a chain is the tree with one branch. A node may have several
children: candidates for the same position. They are judged one after another, each against what the
earlier ones left: recursive rejection sampling,
as in SpecInfer's multi-step speculative sampling (Miao et al. 2024), here with the children drawn
without replacement, as in recursive speculative decoding (Jeon et al. 2024). At a node whose target
distribution is p:
  child 1, x_1 drawn from q_1, is accepted with probability min(1, p(x_1) / q_1(x_1));
  if not, p becomes the residual norm(max(0, p - q_1)) and child 2 is judged against it with its q_2;
  and so on; if every child is rejected (or the node has none) the token is sampled from what p is then.
Each stage is one ordinary speculative-sampling step whose target is the previous stage's residual,
so (Leviathan et al.'s argument, by induction from the last child back) a node emits a token
distributed exactly as p, and the path descends into the accepted child, whose own p is the target's
distribution given that prefix. The one requirement: q_i is the distribution x_i was drawn from *given
the earlier siblings*. Children drawn without replacement (Gumbel top-k) carry q with the earlier
siblings removed and renormalised; deterministic children (greedy drafts) carry a point mass, for
which the rule accepts x_i when it is the target's argmax and otherwise passes p on unchanged (p(x_i)
is 0 then), so greedy output is the target's own token for token. And whether a child is in the tree
at all may depend on anything but the token drawn there (else the kept children are a biased sample:
the drafter ranks the j-th child by its parent's j-th largest probability, not by its own). Chosen
because it is exact for any q, point masses included, uses nothing but the one pass's p, and is the
chain rule when every node has one child: there `decide` takes a shorter path (every verdict at once,
then the accepted prefix) that makes the same draws and choices.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .events import chain
from .sampling import sample
from .transfer import upload


@dataclass
class Decision:
    """One round's verdict, as device tensors."""
    n_accepted: torch.Tensor  # () long: how many nodes the accepted path holds
    token: torch.Tensor  # () long: the target's token (residual sample after a rejection, else the bonus)
    accept_probs: torch.Tensor  # [n] min(1, p(x_i) / q(x_i)) for every drafted node
    uniforms: torch.Tensor  # [n] the uniform draws compared against accept_probs
    rejected: torch.Tensor  # () bool: a node was rejected at the path's end (`dist` is then a residual)
    dist: torch.Tensor  # [V] the distribution `token` was sampled from
    on_path: torch.Tensor  # [n] bool: the node is on the accepted path
    p_x: torch.Tensor  # [n] p(x_i) as judged: after earlier siblings were rejected, their residual's


def point_mass(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """q for a deterministic drafter: it 'samples' its token with probability 1. (A scatter: F.one_hot checks
    its input's range on the host.)"""
    return torch.zeros(*tokens.shape, vocab, device=tokens.device).scatter_(-1, tokens.unsqueeze(-1), 1.0)


def accept_probabilities(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)); a token q could not have produced (q(x) = 0) is never accepted."""
    safe_q = torch.where(q_x > 0, q_x, torch.ones_like(q_x))
    return torch.where(q_x > 0, (p_x / safe_q).clamp(max=1.0), torch.zeros_like(p_x))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what the target adds beyond what the draft already covered.

    It is all zeros only when p == q, where no rejection can happen; p is returned then so the
    function is total (and fuzzing can call it on anything).
    """
    r = (p - q).clamp(min=0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / torch.where(total > 0, total, 1.0), p)


def accepted_prefix(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From the per-token verdicts [k] (True = accepted): the accepted prefix's length and whether a
    drafted token was rejected, as device scalars."""
    k = kept.numel()
    n = kept.long().cumprod(0).sum() if k else torch.zeros((), dtype=torch.long, device=kept.device)
    return n, n < k


def decide(tokens: torch.Tensor, parents: list[int], q: torch.Tensor | None, p: torch.Tensor,
           generator: torch.Generator | None = None) -> Decision:
    """tokens [n] the draft's nodes, parents before children, siblings in the order they were drawn;
    parents[i]: node i's parent (-1: the root, the last committed token; a chain's are events.chain(n));
    q [n, V]: the distribution each node was drawn from given its earlier siblings (None: point masses);
    p [n+1, V]: the target's distribution after the root (row 0) and after each node (row i+1).
    The structure is host data; every value stays on the device, read back with the rest of the round."""
    assert p.shape[0] == tokens.numel() + 1, f"p must have n+1={tokens.numel() + 1} rows, got {p.shape[0]}"
    if parents == chain(len(parents)):
        return _decide_chain(tokens, q, p, generator)
    return _decide_tree(tokens, parents, q, p, generator)


def _decide_chain(tokens, q, p, generator) -> Decision:
    """One child a node: every verdict at once, and the accepted prefix."""
    k = tokens.numel()
    if q is None:
        q = point_mass(tokens, p.shape[-1])
    rows = torch.arange(k, device=p.device)
    p_x = p[rows, tokens]
    accept = accept_probabilities(p_x, q[rows, tokens])
    uniforms = torch.rand(k, generator=generator, device=p.device)
    n, rejected = accepted_prefix(uniforms < accept)
    # at a rejection the token comes from the residual at row n; after a full acceptance, from p there
    at = n.view(1)  # a row picked by a device index: no read back to the host
    p_n = p.index_select(0, at)[0]
    if k:  # row n's q, where n < k (a rejection); after a full acceptance the residual is computed and not taken
        dist = torch.where(rejected, residual_distribution(p_n, q.index_select(0, at.clamp(max=k - 1))[0]), p_n)
    else:  # a plain step: nothing drafted, nothing rejected
        dist = p_n
    token = sample(dist, generator)
    return Decision(n, token, accept, uniforms, rejected, dist, rows < n, p_x)


def _decide_tree(tokens, parents, q, p, generator) -> Decision:
    """Several children a node: each parent's children judged in turn, against what the earlier ones left."""
    n, vocab, device = tokens.numel(), p.shape[-1], p.device
    assert p.shape[0] == n + 1, f"p must have n+1={n + 1} rows, got {p.shape[0]}"
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        assert parent < i, "a node's parent must come before it"
        children.setdefault(parent + 1, []).append(i)

    def q_of(at: torch.Tensor) -> torch.Tensor:  # the q of the node at `at`, a [1] index on the device
        return q.index_select(0, at)[0] if q is not None else point_mass(tokens.index_select(0, at), vocab)[0]

    uniforms = torch.rand(n, generator=generator, device=device)
    false = torch.zeros((), dtype=torch.bool, device=device)
    accept, p_x, hit = [None] * n, [None] * n, [false] * n
    for row, kids in children.items():
        cur, taken = p[row], false
        for j, c in enumerate(kids):
            x = tokens[c:c + 1]
            p_x[c] = cur.gather(0, x)[0]
            accept[c] = accept_probabilities(p_x[c], q[c].gather(0, x)[0] if q is not None else torch.ones_like(p_x[c]))
            hit[c] = ~taken & (uniforms[c] < accept[c])
            if j + 1 < len(kids):  # the next sibling is judged against what this one left
                q_c = q[c] if q is not None else point_mass(x, vocab)[0]
                cur = torch.where(taken | hit[c], cur, residual_distribution(cur, q_c))
            taken = taken | hit[c]
    on_path = []
    for i, parent in enumerate(parents):  # a node is on the path when its parent is and it was accepted
        on_path.append(hit[i] & (on_path[parent] if parent >= 0 else True))
    on_path = torch.stack(on_path) if n else torch.zeros(0, dtype=torch.bool, device=device)
    # the path's last node: of the rows reached, the latest (a path's nodes come in increasing order)
    rows = torch.cat([torch.ones(1, dtype=torch.bool, device=device), on_path])
    end = (rows.long() * torch.arange(n + 1, device=device)).argmax().view(1)
    # its children were all rejected: the token comes from p there with each of them taken out in turn
    width = max((len(kids) for kids in children.values()), default=0)
    table = upload([(children.get(row, []) + [n] * width)[:width] for row in range(n + 1)], device, torch.long)
    dist, ends_at = p.index_select(0, end)[0], table.index_select(0, end)[0] if width else None
    for j in range(width):
        c = ends_at[j:j + 1]
        real = c[0] < n  # a row with fewer children is padded with n
        dist = torch.where(real, residual_distribution(dist, q_of(c.clamp(max=n - 1))), dist)
    token = sample(dist, generator)
    accept, p_x = (torch.stack(v) if n else p.new_zeros(0) for v in (accept, p_x))
    return Decision(on_path.long().sum(), token, accept, uniforms, ends_at[0] < n if width else false, dist,
                    on_path, p_x)
