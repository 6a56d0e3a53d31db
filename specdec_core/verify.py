"""Verification: the accept/reject step of speculative sampling, as pure functions over tensors.

Naming, used everywhere in this project: **p is the target's distribution, q the draft's**
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding").
A drafted token x is accepted with probability min(1, p(x) / q(x)); at the first rejection the
replacement is sampled from the residual norm(max(0, p - q)); when all k are accepted a bonus
token is sampled from p at the position after them. The output then has exactly the target's
distribution, whatever q is, provided q is the distribution x was actually sampled from.

`decide` does all of it on the device, with no value read back to the host, so a GPU never waits
for the CPU in the middle of a round; `verify` is the same decision read back as Python numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Decision:
    """One round's verdict, as device tensors."""
    n_accepted: torch.Tensor  # () long: length of the accepted prefix of the draft
    token: torch.Tensor  # () long: the target's token (residual sample after a rejection, else the bonus)
    accept_probs: torch.Tensor  # [k] min(1, p(x_i) / q(x_i)) for every drafted token
    uniforms: torch.Tensor  # [k] the uniform draws compared against accept_probs
    rejected: torch.Tensor  # () bool: a drafted token was rejected (`dist` is then the residual)
    dist: torch.Tensor  # [V] the distribution `token` was sampled from


@dataclass
class Verdict:
    n_accepted: int  # length of the accepted prefix of the draft (0..k)
    token: int  # the target's token: the residual sample at the first rejection, or the bonus token
    accept_probs: torch.Tensor  # [k] min(1, p(x_i) / q(x_i)) for every drafted token
    uniforms: torch.Tensor  # [k] the uniform draws compared against accept_probs
    residual: torch.Tensor | None  # [V] the distribution `token` was sampled from after a rejection, else None


def point_mass(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """q for a deterministic drafter: it 'samples' its token with probability 1."""
    return torch.nn.functional.one_hot(tokens, vocab).float()


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


def accepted_prefix(kept: torch.Tensor, size: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """From the per-token verdicts [k] (True = accepted): the accepted prefix's length and whether a
    drafted token was rejected, as device scalars; only the first `size` tokens count (all if None)."""
    k = kept.numel()
    if size is not None:
        kept = kept & (torch.arange(k, device=kept.device) < size)
    n = kept.long().cumprod(0).sum() if k else torch.zeros((), dtype=torch.long, device=kept.device)
    return n, n < (k if size is None else size)


def decide(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
           generator: torch.Generator | None = None, size: torch.Tensor | None = None) -> Decision:
    """draft_tokens [k]; q [k, V] (None for a deterministic drafter); p [k+1, V] target probs.
    size: how many of the k tokens are the draft (a device scalar, for a draft cut on the device);
    the rows after it are ignored. All k by default."""
    k = draft_tokens.numel()
    assert p.shape[0] == k + 1, f"p must have k+1={k + 1} rows, got {p.shape[0]}"
    if q is None:
        q = point_mass(draft_tokens, p.shape[-1])
    rows = torch.arange(k, device=p.device)
    accept = accept_probabilities(p[rows, draft_tokens], q[rows, draft_tokens])
    uniforms = torch.rand(k, generator=generator, device=p.device)
    n, rejected = accepted_prefix(uniforms < accept, size)
    # at a rejection the token comes from the residual at row n; after a full acceptance, from p there
    at = n.view(1)  # a row picked by a device index: no read back to the host
    p_n, q_n = p.index_select(0, at)[0], torch.cat([q, q.new_zeros(1, q.shape[-1])]).index_select(0, at)[0]
    dist = torch.where(rejected, residual_distribution(p_n, q_n), p_n)
    token = torch.multinomial(dist, 1, generator=generator)[0]
    return Decision(n, token, accept, uniforms, rejected, dist)


def verify(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
           generator: torch.Generator | None = None) -> Verdict:
    """`decide`, read back: the accepted length and the token as ints, the residual when there was one."""
    d = decide(draft_tokens, q, p, generator)
    return Verdict(int(d.n_accepted), int(d.token), d.accept_probs, d.uniforms, d.dist if bool(d.rejected) else None)
