"""The decoding loop: a generator of RoundEvents that knows nothing about any UI.

Speculative and autoregressive decoding are the same loop; autoregressive decoding is simply a
drafter that proposes nothing, so every round is one single-token target step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count
from typing import Iterator

import torch

from .cache import TreeInput
from .config import MAX_K, MAX_PROMPT_CHARS, SpecConfig
from .drafters import Draft, NoDrafter, make_drafter
from .events import Result, RoundEvent, summarize
from .sampling import NON_FINITE, NonFiniteLogitsError, warp
from .text import encode_prompt
from .timing import Clock
from .transfer import upload
from .verify import TreeDecision, decide, decide_tree


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


def speculative_generate(pair, prompt, cfg: SpecConfig, drafter=None, judge=decide) -> Iterator[RoundEvent]:
    """One event per round: draft k tokens, verify them in one target pass, commit a prefix + 1.
    `judge`: the accept/reject rule (verify.decide; the GPU bench swaps in a simulated one)."""
    drafter = drafter or make_drafter(pair, "model", cfg)
    return decode(pair, prepare(pair, prompt, cfg), cfg, drafter, "speculative", judge)


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


def decode(pair, prompt_ids: list[int], cfg: SpecConfig, drafter, method: str, judge=decide) -> Iterator[RoundEvent]:
    target = pair.cached("target")
    gen = torch.Generator(device=target.device).manual_seed(cfg.seed)
    ids, n_prompt, k = list(prompt_ids), len(prompt_ids), cfg.k
    clock = Clock(target.device)
    # 0) prefill: each cache takes every token but the last, which opens round 1
    target.prefill(ids[:-1])
    drafter.start(ids)
    prefill_s = clock.lap(sync=True)
    for rnd in count(1):
        remaining = cfg.max_new_tokens - (len(ids) - n_prompt)
        k_round = min(k, remaining - 1)  # a round commits at most k+1 tokens
        t0 = clock.mark()
        # 1) draft up to k tokens (with the q each was sampled from)
        draft: Draft = drafter.propose(ids, k_round, cfg, gen)
        t1 = clock.mark()
        # 2) verify: the target scores [last, x_1..x_k] in ONE pass -> p for k+1 positions
        #    (a tree: every node in that one pass, each seeing only its ancestors)
        x = upload(draft.tokens, target.device)
        q = None if draft.q is None else upload(draft.q, target.device)
        # (a tree of one branch is verified as the chain it is: no mask, the same decision)
        chain = draft.parents is None or draft.parents == list(range(-1, len(draft) - 1))
        tree = None if chain else TreeInput([-1] + [parent + 1 for parent in draft.parents])
        logits = target.forward(torch.cat([upload(ids[-1:], target.device), x]), keep=len(draft) + 1,
                                tree=tree)
        p, failed = warp(logits, cfg.temperature, cfg.top_k, cfg.top_p)
        d = judge(x, q, p, gen, draft.size) if tree is None else decide_tree(x, draft.parents, q, p, gen)
        # 3) the round's one read from the device: the decision, and what the event records
        r = read_round(x, q, p, d, failed if draft.failed is None else failed | draft.failed.to(failed.device),
                       draft.size, logits, draft.logits, cfg)
        t2 = clock.mark()
        if r.failed:
            raise NonFiniteLogitsError(NON_FINITE)
        # 4) commit the accepted prefix (a tree: path) and the target's token; stop at EOS or the length cap
        new = [r.drafted[i] for i in r.path] + [r.token]
        eos_at = next((i for i, t in enumerate(new) if t in pair.eos_ids), None)
        if eos_at is not None:
            new = new[: eos_at + 1]
        root = len(ids)  # where the round's first drafted token sits in the target's cache
        ids.extend(new)
        n_gen = len(ids) - n_prompt
        finish = "eos" if eos_at is not None else "length" if n_gen >= cfg.max_new_tokens else None
        if tree is not None:  # keep the path's keys and values, drop the other branches'
            target.compact(root, r.path)
        target.crop(len(ids) - 1)
        drafter.commit(ids)
        target.check()
        assert target.length == len(ids) - 1 and n_gen <= cfg.max_new_tokens
        if cfg.adaptive and r.drafted and draft.parents is None:  # grow after a full acceptance, shrink after a rejection
            k = min(k + 1, MAX_K) if r.accepted == len(r.drafted) else max(1, k - 1)
        draft_s, verify_s = clock.between(t0, t1), clock.between(t1, t2)
        round_s = clock.lap()
        yield RoundEvent(
            method=method, drafter=drafter.name, round=rnd, k=k_round, drafted=r.drafted, accepted=r.accepted,
            token=r.token, committed=new, greedy=cfg.greedy,
            token_kind="target" if method == "autoregressive" else "replacement" if r.rejected else "bonus",
            p_drafted=r.p_drafted, q_drafted=r.q_drafted, accept_probs=r.accept_probs, uniforms=r.uniforms,
            p_token=r.p_token, target_top=r.target_top, draft_top=r.draft_top, residual_top=r.residual_top,
            parents=draft.parents, path=None if draft.parents is None else r.path, expected=draft.expected,
            prefill_s=prefill_s if rnd == 1 else 0.0, draft_s=draft_s, verify_s=verify_s,
            overhead_s=max(round_s - draft_s - verify_s, 0.0), elapsed_s=clock.elapsed,
            n_generated=n_gen, finished=finish is not None, finish_reason=finish)
        if finish:
            return
        clock.resume()


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
    path: list[int] = field(default_factory=list)  # the accepted nodes: a chain's first `accepted`, a tree's path


def read_round(x, q, p, d, failed, size, logits, draft_logits, cfg: SpecConfig) -> Read:
    """Everything the host needs from a round, packed into one tensor and copied back in one transfer.

    Token ids travel as float32, exact below 2**24. The inspector's top-n lists (cfg.record_top) are
    computed only when asked for. Greedy distributions are one-hot, so there the lists show the models'
    own (temperature 1) probabilities instead.
    """
    k, n_top = x.numel(), cfg.record_top
    rows = torch.arange(k, device=p.device)
    q_x = q[rows, x] if q is not None else torch.ones(k, device=p.device)
    p_token = d.dist.gather(0, d.token.view(1))[0]
    drafted = torch.full((), float(k), device=p.device) if size is None else size.float()
    head = torch.stack([failed.float(), d.n_accepted.float(), d.token.float(), d.rejected.float(), p_token, drafted])
    tree = isinstance(d, TreeDecision)
    parts = [head, x.float(), d.p_x if tree else p[rows, x], q_x, d.accept_probs, d.uniforms]
    if tree:
        parts.append(d.on_path.float())
    tops = []
    if n_top:
        shown_p = torch.softmax(logits.float(), -1) if cfg.greedy else p
        tops.append(torch.topk(shown_p, min(n_top, p.shape[-1]), -1))
        if q is not None:
            shown_q = torch.softmax(draft_logits.float(), -1) if cfg.greedy and draft_logits is not None else q
            tops.append(torch.topk(shown_q.to(p.device), min(n_top, p.shape[-1]), -1))
        tops.append(torch.topk(d.dist[None], min(n_top, p.shape[-1]), -1))
        parts += [t for top in tops for t in (top.indices.float().flatten(), top.values.flatten())]
    flat = torch.cat(parts).tolist()  # the one device -> host transfer of the round
    failed_, n, token, rejected, p_token, size_ = flat[:6]
    at, cut = 6, int(size_)

    def take(count):
        nonlocal at
        at += count
        return flat[at - count: at]

    columns = [take(k) for _ in range(5)]
    drafted, p_x, q_x, accept, uniforms = (c[:cut] for c in columns)
    path = [i for i, x in enumerate(take(k)) if x] if tree else list(range(int(n)))
    tables = []
    for top in tops:
        n_rows, width = top.indices.shape
        ids, vals = take(n_rows * width), take(n_rows * width)
        tables.append([[(int(i), v) for i, v in zip(ids[r * width:(r + 1) * width], vals[r * width:(r + 1) * width])]
                       for r in range(n_rows)])
    read = Read(bool(failed_), int(n), int(token), bool(rejected), p_token, [int(t) for t in drafted], p_x, q_x,
                accept, uniforms, path=path)
    if n_top:
        read.target_top = tables[0][: cut + 1]
        read.draft_top = tables[1][:cut] if q is not None else []
        read.residual_top = tables[-1][0] if read.rejected else None
    else:
        read.target_top = [[] for _ in range(cut + 1)]
        read.draft_top = [[] for _ in range(cut)] if q is not None else []
    return read
