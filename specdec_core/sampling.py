"""Turning logits into the distribution tokens are sampled from.

The same function warps the draft's and the target's logits, so both distributions are
computed identically (float32, same temperature / top-k / top-p). Temperature 0 gives a
one-hot distribution at the argmax, so greedy decoding is the same algorithm with
deterministic distributions rather than a separate code path.
"""
from __future__ import annotations

import torch

from .transfer import upload


class NonFiniteLogitsError(RuntimeError):
    """A model produced NaN or infinite logits (for example float16 overflow)."""


NON_FINITE = "the model produced NaN or infinite logits; no token was taken from them"


def warp(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., V] logits -> ([..., V] float32 probabilities, a () bool tensor: some row held NaN or +inf).

    Nothing is read back to the host: the caller reads the flag together with the rest of its round
    and raises NonFiniteLogitsError before anything is committed. A failed row is sampled from
    harmlessly (a one-hot at its argmax when greedy, uniform otherwise) and never used.
    """
    logits = logits.float()
    # -inf is a legitimate mask (a pruned draft head); NaN and +inf are failures. A row's max is NaN
    # or +inf exactly when the row holds one, so one pass checks every row (this runs for every draft
    # token and every verified row: a pass over 150k logits each). Greedy needs the argmax too; sampling
    # takes the max alone, which a CPU finds in a fifteenth of the time.
    top, argmax = logits.max(-1, keepdim=True) if temperature == 0.0 else (logits.amax(-1, keepdim=True), None)
    failed = torch.isnan(top) | torch.isposinf(top)
    if temperature == 0.0:
        return torch.zeros_like(logits).scatter_(-1, argmax, 1.0), failed.any()  # ties: the first maximum
    logits = torch.where(failed, 0.0, logits) / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs, failed.any()


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of [..., V] probabilities, which need not sum to 1 (a residual's), at one uniform draw a
    row. (torch.multinomial draws one exponential per token of the vocabulary, which costs a CPU many times more.)"""
    u = torch.rand(*probs.shape[:-1], 1, generator=generator, device=probs.device, dtype=torch.float64)
    return invert(probs, u)


def invert(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row whose share of the row's total holds u [..., 1] in [0, 1): token i holds
    [cdf(i - 1), cdf(i)) of it (in float64), so a token of probability 0 holds nothing."""
    cdf = probs.double().cumsum(-1)
    # u * total < total, rounded too (u <= 1 - 2^-53): the token found has cdf(i) > cdf(i - 1), a probability > 0
    return torch.searchsorted(cdf, u * cdf[..., -1:], right=True)[..., 0]


def children(q: torch.Tensor, logits: torch.Tensor, width: int, cfg, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `width` children [rows, width], and the probabilities that rank them: the j-th child is ranked
    at its row's j-th largest probability (under q; greedy, whose q is one-hot: under the draft's softmax)."""
    ranked = torch.softmax(logits.float(), -1) if cfg.greedy else q
    if width == 1:  # a chain: the argmax, or one draw from q, ranked at the largest probability (found without its
        # index, in a thirtieth of topk's time on a CPU)
        picks = q.argmax(-1, keepdim=True) if cfg.greedy else sample(q, generator)[..., None]
        return ranked.amax(-1, keepdim=True), picks
    top, picks = torch.topk(ranked, width, -1)
    if not cfg.greedy:  # Gumbel top-k: `width` draws without replacement, in the order drawn
        u = torch.rand(q.shape, generator=generator, device=q.device).clamp_(min=1e-20)
        picks = torch.topk(torch.where(q > 0, q.log() - (-u.log()).log(), float("-inf")), width, -1).indices
    return top, picks


def without(q: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """q with `tokens` removed and renormalised: the distribution of a draw made after them without replacement."""
    if not tokens:
        return q
    q = q.index_fill(0, upload(tokens, q.device, torch.long), 0.0)
    return q / q.sum()
