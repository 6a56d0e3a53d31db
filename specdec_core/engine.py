"""The decoding loop: a generator of RoundEvents that knows nothing about any UI.

Speculative and autoregressive decoding are the same loop; autoregressive decoding is simply a
drafter that proposes nothing, so every round is one single-token target step.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from itertools import count
from typing import Iterator

import torch

from .cache import TreeInput
from .config import MAX_K, MAX_PROMPT_CHARS, SpecConfig
from .drafters import make_drafter
from .drafts import Draft, NoDrafter
from .events import Prefilling, Result, RoundEvent, chain, summarize, tree_depths
from .messages import Refusal
from .sampling import NON_FINITE, NonFiniteLogitsError, warp
from .text import encode_prompt
from .timing import Clock
from .transfer import Transfer, upload
from .verify import Decision, decide


def encode_request(pair, prompt: str | list[int], cfg: SpecConfig) -> list[int]:
    """The prompt's token ids, checked against the limits and the model's context (ValueError with a message)."""
    if isinstance(prompt, str) and len(prompt) > MAX_PROMPT_CHARS:
        raise Refusal("prompt_chars", n=len(prompt), limit=MAX_PROMPT_CHARS)
    ids = encode_prompt(pair.tokenizer, prompt, cfg.chat) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise Refusal("prompt_no_tokens")
    if len(ids) + cfg.max_new_tokens > pair.context_length:
        raise Refusal("prompt_context", n=len(ids), new=cfg.max_new_tokens, context=pair.context_length)
    return ids


def speculative_generate(pair, prompt, cfg: SpecConfig, drafter=None, judge=decide,
                         progress: bool = False) -> Iterator[RoundEvent | Prefilling]:
    """One event per round: draft k tokens, verify them in one target pass, commit a prefix + 1.
    `judge`: the accept/reject rule (verify.decide; the GPU bench swaps in a simulated one).
    `progress`: a Prefilling before the prompt and after each of its chunks, too."""
    drafter = drafter or make_drafter(pair, cfg=cfg)
    return decode(pair, encode_request(pair, prompt, cfg), cfg, drafter, "speculative", judge, progress)


def autoregressive_generate(pair, prompt, cfg: SpecConfig, progress: bool = False) -> Iterator[RoundEvent | Prefilling]:
    """One event per token: the target alone, through the same loop."""
    return decode(pair, encode_request(pair, prompt, cfg), cfg, NoDrafter(), "autoregressive", progress=progress)


def generate(pair, prompt, cfg: SpecConfig, method: str = "speculative", drafter=None) -> Result:
    prompt_ids = encode_request(pair, prompt, cfg)
    if method == "speculative":
        stream = speculative_generate(pair, prompt_ids, cfg, drafter)
    elif method == "autoregressive":
        stream = autoregressive_generate(pair, prompt_ids, cfg)
    else:
        raise Refusal("method_unknown", value=repr(method))
    events = list(stream)
    ids = [t for e in events for t in e.committed]
    text = pair.tokenizer.decode(ids, skip_special_tokens=True)
    return Result(prompt_ids, ids, text, summarize(events), events)


def decode(pair, prompt_ids: list[int], cfg: SpecConfig, drafter, method: str, judge=decide,
           progress: bool = False) -> Iterator[RoundEvent | Prefilling]:
    target = pair.cached("target")
    gen = torch.Generator(device=target.device).manual_seed(cfg.seed)
    ids, n_prompt, k = list(prompt_ids), len(prompt_ids), cfg.k
    clock = Clock(target.device)
    # 0) prefill: each cache takes every token but the last, which opens round 1, a chunk at a time; with `progress`
    # a Prefilling before the first and after each (a consumer that stops taking events there stops the prefill)
    chunks = itertools.chain([("target", 0)], (("target", n) for n in target.prefill_chunks(ids[:-1])),
                   (("draft", n) for n in drafter.start(ids)))
    for model, done in chunks:
        if progress:
            clock.lap(sync=True)
            yield Prefilling(model, done, n_prompt - 1, clock.elapsed)
            clock.resume()
    clock.lap(sync=True)
    prefill_s = clock.elapsed
    for rnd in count(1):
        k_round = min(k, cfg.max_new_tokens - (len(ids) - n_prompt) - 1)  # a round commits at most k+1 tokens
        t0 = clock.mark()
        # 1) draft up to k tokens (with the q each was sampled from)
        draft: Draft = drafter.propose(ids, k_round, cfg, gen)
        t1 = clock.mark()
        # 2) verify them in one target pass, and read the round back in one transfer
        r = verify_draft(target, ids[-1], draft, cfg, gen, judge)
        t2 = clock.mark()
        if r.failed:
            raise NonFiniteLogitsError(NON_FINITE)
        # 3) commit the accepted path and the target's token; stop at EOS or the length cap
        new, finish = commit(target, ids, r, pair.eos_ids, n_prompt, cfg.max_new_tokens)
        if cfg.adaptive and r.drafted:  # deeper after a path accepted to the draft's depth, shallower after a rejection
            k = min(k + 1, MAX_K) if r.accepted == max(tree_depths(r.parents)) else max(1, k - 1)
        # 4) the event: what was decided, and where the time went
        draft_s, verify_s = clock.between(t0, t1), clock.between(t1, t2)
        draft.verified_s = verify_s  # the drafter reads it when it next proposes
        round_s = clock.lap()
        yield RoundEvent(
            method=method, drafter=drafter.name, round=rnd, k=k_round, drafted=r.drafted, accepted=r.accepted,
            token=r.token, committed=new, greedy=cfg.greedy,
            token_kind="target" if method == "autoregressive" else "replacement" if r.rejected else "bonus",
            p_drafted=r.p_drafted, q_drafted=r.q_drafted, accept_probs=r.accept_probs, uniforms=r.uniforms,
            p_token=r.p_token, target_top=r.target_top, draft_top=r.draft_top, residual_top=r.residual_top,
            parents=r.parents, path=r.path, expected=draft.expected, draft_steps=draft.forwards, curve=draft.curve,
            gain=draft.gain, step_ms=draft.step_ms,
            prefill_s=prefill_s if rnd == 1 else 0.0, draft_s=draft_s, verify_s=verify_s,
            overhead_s=max(round_s - draft_s - verify_s, 0.0), elapsed_s=clock.elapsed,
            n_generated=len(ids) - n_prompt, finished=finish is not None, finish_reason=finish)
        if finish:
            return
        clock.resume()


def verify_draft(target, last: int, draft: Draft, cfg: SpecConfig, gen, judge) -> Read:
    """The target scores [last, x_1..x_k] in ONE pass (each node seeing only its ancestors: a mask where the draft
    branches), the rule decides, and everything the host needs comes back in the round's one read."""
    x = upload(draft.tokens, target.device)
    q = None if draft.q is None else upload(draft.q, target.device)
    parents = [-1] + [parent + 1 for parent in draft.parents]
    tree = None if parents == chain(len(parents)) else TreeInput(parents)
    logits = target.forward(torch.cat([upload([last], target.device), x]), keep=len(draft) + 1, tree=tree)
    p, failed = warp(logits, cfg.temperature, cfg.top_k, cfg.top_p)
    d = judge(x, draft.parents, q, p, gen)
    failed = failed if draft.failed is None else failed | draft.failed.to(failed.device)
    return read_round(dataclasses.replace(draft, tokens=x, q=q, failed=failed), logits, p, d, cfg)


def commit(target, ids: list[int], r: Read, eos_ids, n_prompt: int, max_new: int):
    """Append the round's tokens to `ids` (cut after an EOS) and bring the target's cache to them: (new tokens,
    finish). The drafter reads them from `ids` when it next proposes."""
    new = [r.drafted[i] for i in r.path] + [r.token]
    eos_at = next((i for i, t in enumerate(new) if t in eos_ids), None)
    if eos_at is not None:
        new = new[: eos_at + 1]
    root = len(ids)  # where the round's first drafted token sits in the target's cache
    ids.extend(new)
    n_gen = len(ids) - n_prompt
    target.compact(root, r.path)  # keep the path's keys and values, drop the other branches' (a chain's: in place)
    target.crop(len(ids) - 1)
    target.check()
    assert target.length == len(ids) - 1 and n_gen <= max_new
    return new, "eos" if eos_at is not None else "length" if n_gen >= max_new else None


@dataclass
class Read:
    """A round's outcome on the host."""
    failed: bool
    accepted: int
    token: int
    rejected: bool
    p_token: float
    drafted: list[int]
    p_drafted: list[float]
    q_drafted: list[float]
    accept_probs: list[float]
    uniforms: list[float]
    target_top: list = field(default_factory=list)
    draft_top: list = field(default_factory=list)
    residual_top: list | None = None
    parents: list[int] = field(default_factory=list)  # the draft's shape
    path: list[int] = field(default_factory=list)  # the accepted nodes, root to leaf


def read_round(draft: Draft, logits, p, d: Decision, cfg: SpecConfig) -> Read:
    """Everything the host needs from a round, in one transfer: the draft (on the target's device, its `failed` the
    round's), the target's logits and distributions, the decision. The inspector's top-n lists (cfg.record_top)
    are computed only when asked for. Greedy distributions are one-hot, so there the lists show the models' own
    (temperature 1) probabilities instead."""
    x, q, k, n_top = draft.tokens, draft.q, len(draft), min(cfg.record_top, p.shape[-1])
    rows = torch.arange(k, device=p.device)
    t = Transfer()
    t.put("failed", draft.failed)
    t.put("accepted", d.n_accepted)
    t.put("token", d.token)
    t.put("rejected", d.rejected)
    t.put("drafted", x)
    t.put("on_path", d.on_path)
    t.put("p_token", d.dist.gather(0, d.token.view(1))[0], floats=True)
    t.put("p_drafted", d.p_x, floats=True)
    t.put("q_drafted", q[rows, x] if q is not None else torch.ones(k, device=p.device), floats=True)
    t.put("accept_probs", d.accept_probs, floats=True)
    t.put("uniforms", d.uniforms, floats=True)
    tops = {}
    if n_top:
        tops["target"] = torch.softmax(logits.float(), -1) if cfg.greedy else p
        shown = torch.softmax(draft.logits.float(), -1) if cfg.greedy and draft.logits is not None else q
        if shown is not None:
            tops["draft"] = shown
        tops["residual"] = d.dist[None]
    for name, dist in tops.items():
        top = torch.topk(dist.to(p.device), n_top, -1)
        t.put(f"{name}_ids", top.indices)
        t.put(f"{name}_p", top.values, floats=True)
    v = t.read()
    table = lambda name: [list(zip(i, pr)) for i, pr in zip(v[f"{name}_ids"], v[f"{name}_p"])]
    read = Read(bool(v["failed"]), v["accepted"], v["token"], bool(v["rejected"]), v["p_token"], v["drafted"],
                *(v[name] for name in ("p_drafted", "q_drafted", "accept_probs", "uniforms")),
                parents=draft.parents, path=[i for i, on in enumerate(v["on_path"]) if on])
    read.target_top = table("target") if n_top else [[] for _ in range(k + 1)]
    read.draft_top = table("draft") if "draft" in tops else []
    read.residual_top = table("residual")[0] if n_top and read.rejected else None
    return read
