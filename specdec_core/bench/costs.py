"""What a step, a pass, a prompt and each part of a draft step cost: the bench's tables of costs (--contexts,
--draft-table)."""
from __future__ import annotations

import statistics
import time

import torch

from ..drafters import rare_tokens
from ..models.step import DraftStep, Int4Product
from ..sampling import warp
from ..timing import contexts_ms, median_ms, pass_ms, prompt_ms


def costs_by_context(pair, contexts: list[int], k: int) -> dict:
    """The target's one-token step and its (k+1)-token verification pass, and a draft step, at each context
    length: what a long conversation costs each of them (milliseconds, median of 10 after warm-up, the contexts
    timed in turn so that their ratio survives the machine's drift); and what a prompt of that length costs the
    target and the draft (timed once each)."""
    target = contexts_ms(pair, "target", contexts, (1, k + 1))
    draft = contexts_ms(pair, "draft", contexts, (1,)) if pair.draft is not None else {}
    return {c: {"step_ms": target[c][1], f"pass_{k + 1}_ms": target[c][k + 1],
                "draft_step_ms": draft[c][1] if draft else None, "prompt_ms": prompt_ms(pair, "target", c),
                "draft_prompt_ms": prompt_ms(pair, "draft", c) if draft else None} for c in contexts}


def draft_step_table(pair, context: int = 128, reps: int = 30) -> dict:
    """Where a draft step's time goes: per part of the model (all layers' attention blocks, MLPs and norms, the
    head), milliseconds and megabytes of weights read, timed with hooks (each its share of a step timed without
    them); sampling (warp and argmax) timed apart; what is left of a step is Python and dispatch outside those. Where
    a race's steps leave the rare ids out of the head (drafters.rare_tokens), that head is timed too, apart."""
    lm, model = pair.cached("draft"), pair.draft
    lm.prefill(list(range(1, context)))
    x = torch.ones(1, dtype=torch.long, device=lm.device)

    def step():
        lm.forward(x, keep=1)
        lm.crop(context - 1)

    total = median_ms(step, lm.device, reps)
    logits = lm.forward(x, keep=1)
    lm.crop(context - 1)
    sampling = {"ms": median_ms(lambda: warp(logits, 0.0)[0].argmax(-1), lm.device, reps), "mb": 0.0}
    if lm.written is not None:
        table = written_step_table(lm.written, model, reps, rare_tokens(pair))
        rare = table.pop("head, rare ids left out", None)
        table["sampling"] = sampling
        table["attention, norms, rotation, cache and Python"] = {
            "ms": max(total - sum(v["ms"] for v in table.values()), 0.0), "mb": 0.0}
        return {"context": context, "step_ms": total, "target_step_ms": pass_ms(pair, "target", context, 1),
                "parts": table, **({"head_without_rare": rare} if rare else {})}
    table = hooked_step_table(model, step, total, reps)
    rest = {"ms": max(total - sum(v["ms"] for v in table.values()), 0.0), "mb": 0.0}
    return {"context": context, "step_ms": total, "target_step_ms": pass_ms(pair, "target", context, 1),
            "parts": {**table, "sampling": sampling, "python and dispatch": rest}}


def hooked_step_table(model, step, total: float, reps: int) -> dict:
    """A general forward's parts (all layers' attention blocks, MLPs and norms, the head), timed with hooks over `reps`
    steps, each given its share of `total`, a step timed without them (hooks slow a small model's steps)."""
    layers = model.get_decoder().layers
    parts = {"attention": [m.self_attn for m in layers], "mlp": [m.mlp for m in layers],
             "norms": [n for m in layers for n in (m.input_layernorm, m.post_attention_layernorm)]
             + [model.get_decoder().norm], "head": [model.get_output_embeddings()]}
    spent = {name: 0.0 for name in parts}
    hooks = []
    for name, modules in parts.items():
        for module in modules:
            hooks.append(module.register_forward_pre_hook(lambda *a, name=name: spent.__setitem__(
                name, spent[name] - time.perf_counter())))
            hooks.append(module.register_forward_hook(lambda *a, name=name: spent.__setitem__(
                name, spent[name] + time.perf_counter())))
    try:
        hooked = time.perf_counter()
        for _ in range(reps):
            step()
        hooked = time.perf_counter() - hooked
    finally:
        for hook in hooks:
            hook.remove()
    return {name: {"ms": spent[name] / hooked * total, "mb": megabytes(modules)} for name, modules in parts.items()}


def written_step_table(step: DraftStep, model, reps: int, rare: tuple[int, int] | None = None) -> dict:
    """The written-out step's parts that read weights, timed as a step runs them, so that their weights come from
    memory, not a cache: every layer's int4 products in turn, and the head after them (timed alone, call after call,
    its weights stay partly cached and it reads faster than in a step); with `rare`, the layers' products again and
    the head without those ids (step.DraftStep.logits)."""
    products = [part for layer in step.layers for part in layer if isinstance(part, Int4Product)]
    inputs = {p.in_features: torch.zeros(1, p.in_features, dtype=torch.bfloat16) for p in products}
    head = model.get_output_embeddings()
    hidden = inputs[step.hidden]

    skips = rare is not None and getattr(head, "tiles", None) is not None  # else it would run the whole head
    heads = {"head": head, **({"rare": lambda x: step.logits(x, rare)} if skips else {})}
    spent = {"products": [], **{part: [] for part in heads}}
    for _ in range(reps + 3):  # the first three warm up
        for part, logits in heads.items():
            t0 = time.perf_counter()
            for product in products:
                product(inputs[product.in_features])
            t1 = time.perf_counter()
            logits(hidden)
            spent["products"].append(t1 - t0)
            spent[part].append(time.perf_counter() - t1)
    ms = {part: statistics.median(times[3:]) * 1000 for part, times in spent.items()}
    table = {"int4 projections": {"ms": ms["products"], "mb": megabytes([m for p in products for m in p.linears])},
             "head": {"ms": ms["head"], "mb": megabytes([head])}}
    if skips:
        table["head, rare ids left out"] = {"ms": ms["rare"],
                                            "mb": table["head"]["mb"] * (1 - (rare[1] - rare[0]) / head.out_features)}
    return table


def megabytes(modules) -> float:
    """The weights (parameters and buffers) the modules read, in MB."""
    return sum(t.numel() * t.element_size() for m in modules for t in [*m.parameters(), *m.buffers()]) / 1e6
