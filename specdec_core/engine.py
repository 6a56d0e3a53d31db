"""The decoding loop: a generator of RoundEvents that knows nothing about any UI.

Speculative and autoregressive decoding are the same loop; autoregressive decoding is simply a
drafter that proposes nothing, so every round is one single-token target step.
"""
from __future__ import annotations

import time
from itertools import count
from typing import Iterator

import torch

from .cache import CachedModel
from .config import MAX_K, MAX_PROMPT_CHARS, SpecConfig
from .drafters import Draft, EarlyExitDrafter, HybridDrafter, ModelDrafter, NoDrafter, PromptLookupDrafter
from .events import Result, RoundEvent, summarize
from .sampling import logits_to_probs, top_entries
from .text import encode_prompt
from .verify import verify


class Clock:
    """This decoder's own compute time: it stops while the consumer of the events holds control,
    so two decoders interleaved on one device are each charged only their own work."""

    def __init__(self, device: torch.device):
        kind = torch.device(device).type
        self._sync = {"cuda": torch.cuda.synchronize, "mps": getattr(torch, "mps", None) and torch.mps.synchronize}.get(kind)
        self.elapsed, self._t = 0.0, time.perf_counter()

    def lap(self) -> float:
        if self._sync:
            self._sync()
        now = time.perf_counter()
        d, self._t = now - self._t, now
        self.elapsed += d
        return d

    def resume(self) -> None:
        self._t = time.perf_counter()


def prepare(pair, prompt: str | list[int], cfg: SpecConfig) -> list[int]:
    if isinstance(prompt, str) and len(prompt) > MAX_PROMPT_CHARS:
        raise ValueError(f"The prompt is {len(prompt):,} characters; the limit is {MAX_PROMPT_CHARS:,}.")
    ids = encode_prompt(pair.tokenizer, prompt, cfg.chat) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise ValueError("The prompt encodes to no tokens.")
    if len(ids) + cfg.max_new_tokens > pair.context_length:
        raise ValueError(f"The prompt is {len(ids)} tokens; with max_new_tokens={cfg.max_new_tokens} that exceeds "
                         f"the model's context of {pair.context_length} tokens. Shorten the prompt or ask for fewer tokens.")
    return ids


def make_drafter(pair, name: str = "model", layers: int | None = None):
    """By name: "model" (the pair's draft), "prompt-lookup" (n-grams), "hybrid" (n-grams when text is
    copied, else the draft), "early-exit" (the target's first `layers` layers; a quarter by default)."""
    if name in ("model", "hybrid"):
        if pair.draft is None:
            raise ValueError(f"The pair {pair.name!r} has no draft model; choose prompt-lookup or early-exit.")
        drafter = ModelDrafter(pair.draft, pair.vocab)
        return drafter if name == "model" else HybridDrafter(drafter)
    if name == "prompt-lookup":
        return PromptLookupDrafter()
    if name == "early-exit":
        return EarlyExitDrafter(pair.target, pair.vocab, layers or max(1, len(pair.target.get_decoder().layers) // 4))
    raise ValueError(f"Unknown drafter {name!r}: use model, hybrid, prompt-lookup or early-exit.")


def speculative_generate(pair, prompt, cfg: SpecConfig, drafter=None) -> Iterator[RoundEvent]:
    """One event per round: draft k tokens, verify them in one target pass, commit a prefix + 1."""
    return decode(pair, prepare(pair, prompt, cfg), cfg, drafter or make_drafter(pair), "speculative")


def autoregressive_generate(pair, prompt, cfg: SpecConfig) -> Iterator[RoundEvent]:
    """One event per token: the target alone, through the same loop."""
    return decode(pair, prepare(pair, prompt, cfg), cfg, NoDrafter(), "autoregressive")


def generate(pair, prompt, cfg: SpecConfig, method: str = "speculative", drafter=None) -> Result:
    prompt_ids = prepare(pair, prompt, cfg)
    if method == "speculative":
        stream = speculative_generate(pair, prompt_ids, cfg, drafter)
    elif method == "autoregressive":
        stream = autoregressive_generate(pair, prompt_ids, cfg)
    else:
        raise ValueError(f"method must be 'speculative' or 'autoregressive', got {method!r}")
    events = list(stream)
    ids = [t for e in events for t in e.committed]
    text = pair.tokenizer.decode(ids, skip_special_tokens=True)
    return Result(prompt_ids, ids, text, summarize(events), events)


def decode(pair, prompt_ids: list[int], cfg: SpecConfig, drafter, method: str) -> Iterator[RoundEvent]:
    target = CachedModel(pair.target, pair.vocab)
    gen = torch.Generator(device=target.device).manual_seed(cfg.seed)
    warp = lambda logits: logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
    ids, n_prompt, k = list(prompt_ids), len(prompt_ids), cfg.k
    clock = Clock(target.device)
    # 0) prefill: each cache takes every token but the last, which opens round 1
    target.prefill(ids[:-1])
    drafter.start(ids)
    prefill_s = clock.lap()
    for rnd in count(1):
        remaining = cfg.max_new_tokens - (len(ids) - n_prompt)
        k_round = min(k, remaining - 1)  # a round commits at most k+1 tokens
        # 1) draft up to k tokens (with the q each was sampled from)
        draft: Draft = drafter.propose(ids, k_round, cfg, gen)
        draft_s = clock.lap()
        # 2) verify: the target scores [last, x_1..x_k] in ONE pass -> p for k+1 positions
        x = draft.tokens.to(target.device)
        logits = target.forward(torch.cat([torch.tensor(ids[-1:], device=target.device), x]), keep=len(draft) + 1)
        p = warp(logits)
        v = verify(x, None if draft.q is None else draft.q.to(target.device), p, gen)
        verify_s = clock.lap()
        # 3) commit the accepted prefix and the target's token; stop at EOS or the length cap
        drafted = x.tolist()
        new = drafted[: v.n_accepted] + [v.token]
        eos_at = next((i for i, t in enumerate(new) if t in pair.eos_ids), None)
        if eos_at is not None:
            new = new[: eos_at + 1]
        ids.extend(new)
        n_gen = len(ids) - n_prompt
        finish = "eos" if eos_at is not None else "length" if n_gen >= cfg.max_new_tokens else None
        target.crop(len(ids) - 1)
        drafter.commit(len(ids))
        target.check()
        assert target.length == len(ids) - 1 and n_gen <= cfg.max_new_tokens
        if cfg.adaptive and len(draft):  # grow after a full acceptance, shrink after a rejection
            k = min(k + 1, MAX_K) if v.n_accepted == len(draft) else max(1, k - 1)
        event = _event(method, drafter.name, rnd, k_round, drafted, v, new, p, logits, draft, cfg,
                       prefill_s if rnd == 1 else 0.0, draft_s, verify_s, n_gen, finish)
        event.overhead_s = clock.lap()
        event.elapsed_s = clock.elapsed
        yield event
        if finish:
            return
        clock.resume()


def _event(method, drafter, rnd, k, drafted, v, new, p, logits, draft, cfg, prefill_s, draft_s, verify_s, n_gen, finish):
    n = len(drafted)
    rows = torch.arange(n, device=p.device)
    x = torch.tensor(drafted, dtype=torch.long, device=p.device)
    q_x = draft.q.to(p.device)[rows, x].tolist() if draft.q is not None else [1.0] * n
    token_dist = v.residual if v.residual is not None else p[v.n_accepted]
    # greedy distributions are one-hot; show the models' own (temperature 1) probabilities instead
    shown_p = torch.softmax(logits.float(), -1) if cfg.greedy else p
    shown_q = None
    if draft.q is not None:
        shown_q = torch.softmax(draft.logits.float(), -1) if cfg.greedy and draft.logits is not None else draft.q
    return RoundEvent(
        method=method, drafter=drafter, round=rnd, k=k, drafted=drafted, accepted=v.n_accepted, token=v.token,
        token_kind="target" if method == "autoregressive" else "bonus" if v.residual is None else "replacement",
        committed=new, p_drafted=p[rows, x].tolist(), q_drafted=q_x, accept_probs=v.accept_probs.tolist(),
        uniforms=v.uniforms.tolist(), p_token=float(token_dist[v.token]), greedy=cfg.greedy,
        target_top=top_entries(shown_p, cfg.record_top),
        draft_top=top_entries(shown_q, cfg.record_top) if shown_q is not None else [],
        residual_top=top_entries(v.residual[None], cfg.record_top)[0] if v.residual is not None else None,
        prefill_s=prefill_s, draft_s=draft_s, verify_s=verify_s, overhead_s=0.0, elapsed_s=0.0,
        n_generated=n_gen, finished=finish is not None, finish_reason=finish)
