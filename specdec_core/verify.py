"""Verification: the accept/reject step of speculative sampling, as pure functions over tensors.

Naming, used everywhere in this project: **p is the target's distribution, q the draft's**
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding").
A drafted token x is accepted with probability min(1, p(x) / q(x)); at the first rejection the
replacement is sampled from the residual norm(max(0, p - q)); when all k are accepted a bonus
token is sampled from p at the position after them. The output then has exactly the target's
distribution, whatever q is, provided q is the distribution x was actually sampled from.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
    total = r.sum()
    return r / total if total > 0 else p


def verify(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
           generator: torch.Generator | None = None) -> Verdict:
    """draft_tokens [k]; q [k, V] (None for a deterministic drafter); p [k+1, V] target probs."""
    k = draft_tokens.numel()
    assert p.shape[0] == k + 1, f"p must have k+1={k + 1} rows, got {p.shape[0]}"
    if q is None:
        q = point_mass(draft_tokens, p.shape[-1])
    rows = torch.arange(k, device=p.device)
    accept = accept_probabilities(p[rows, draft_tokens], q[rows, draft_tokens])
    uniforms = torch.rand(k, generator=generator, device=p.device)
    n = int((uniforms < accept).int().cumprod(0).sum()) if k else 0
    if n < k:  # rejected at position n: the target's token comes from the residual there
        residual = residual_distribution(p[n], q[n])
        dist = residual
    else:  # everything accepted: one bonus token from the target, for free
        residual, dist = None, p[k]
    token = int(torch.multinomial(dist, 1, generator=generator))
    return Verdict(n, token, accept, uniforms, residual)
