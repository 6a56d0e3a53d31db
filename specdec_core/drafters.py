"""Drafters: anything that proposes the next k tokens. The target verifies all of them, so a
drafter only changes speed (how many are accepted), never the output distribution.

Interface (three methods):
  start(ids)                      prefill with the prompt
  propose(ids, k, cfg, generator) -> Draft: up to k tokens, and the distributions q they were
                                   sampled from (None for a deterministic drafter: q is a point mass);
                                   on a GPU the tokens stay on the device, and so may the draft's length
  commit(n_ids)                   the round committed tokens; the sequence now has n_ids tokens
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from .cache import CachedModel
from .sampling import sample, warp


@dataclass
class Draft:
    tokens: torch.Tensor  # [k'] proposed ids, k' <= k
    q: torch.Tensor | None  # [k', V] distributions they were sampled from; None = deterministic drafter
    logits: torch.Tensor | None = None  # [k', V] raw draft logits, kept only for display (cfg.record_top)
    size: torch.Tensor | None = None  # () on the device: only the first `size` tokens are the draft (None: all)
    failed: torch.Tensor | None = None  # () bool on the device: the draft produced NaN or +inf logits

    def __len__(self) -> int:
        return self.tokens.numel()


class NoDrafter:
    """Proposes nothing: every round is one plain target step. This is autoregressive decoding."""

    name = "none"

    def start(self, ids):
        pass

    def propose(self, ids, k, cfg, generator):
        return Draft(torch.empty(0, dtype=torch.long), None)

    def commit(self, n_ids):
        pass


class ModelDrafter:
    """A small causal LM drafts k tokens autoregressively, sampling each from warped q.

    The confidence cut (cfg.min_confidence) stops a draft once the product of the draft's top
    probabilities falls below the threshold. A CPU reads each step's confidence and stops there: the
    read costs nothing and the steps saved are slow. A GPU must not wait for the host between steps,
    so it drafts all k and the cut becomes the draft's `size`, a number that stays on the device.
    """

    name = "model"

    def __init__(self, lm: CachedModel, cut_on_device: bool | None = None):
        self.lm = lm
        self.cut_on_device = lm.device.type != "cpu" if cut_on_device is None else cut_on_device

    def start(self, ids):
        self.lm.reset()
        self.lm.prefill(ids[:-1])

    def propose(self, ids, k, cfg, generator):
        # The cache holds ids[:length]; feed the rest. After a fully accepted round that is two
        # tokens (the last drafted token, never fed, and the target's bonus token).
        x = torch.tensor(ids[self.lm.length:], device=self.lm.device)
        tokens, qs, raw, failed, tops, sure = [], [], [], [], [], 1.0
        for _ in range(k):
            logits = self.lm.forward(x, keep=1)[0]
            q, bad = warp(logits, cfg.temperature, cfg.top_k, cfg.top_p)
            x = q.argmax(-1, keepdim=True) if cfg.greedy else sample(q[None], generator)
            tokens.append(x.view(1))
            qs.append(q)
            raw.append(logits)
            failed.append(bad)
            if cfg.min_confidence:
                # the draft's own chance that every token so far is right; once that is low, the next
                # token is unlikely to be reached
                tops.append(torch.softmax(logits.float(), -1).max())
                if not self.cut_on_device:
                    sure *= float(tops[-1])
                    if sure < cfg.min_confidence:
                        break
        if not tokens:
            return Draft(torch.empty(0, dtype=torch.long, device=self.lm.device), None)
        size = None
        if cfg.min_confidence and self.cut_on_device:
            sure = torch.stack(tops).to(torch.float32 if self.lm.device.type == "mps" else torch.float64).cumprod(0)
            size = ((sure >= cfg.min_confidence).sum() + 1).clamp(max=len(tokens))
        shown = torch.stack(raw) if cfg.record_top else None  # the inspector's greedy view only
        return Draft(torch.cat(tokens), torch.stack(qs), shown, size, torch.stack(failed).any())

    def commit(self, n_ids):
        # keep only the committed prefix; the newest committed token is fed next round
        self.lm.crop(n_ids - 1)
        self.lm.check()


class PromptLookupDrafter:
    """No model: find the latest earlier occurrence of the last n tokens and propose what followed.

    Nearly free, and strong whenever the output copies from the prompt (editing, extraction).
    """

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, ids):
        pass

    def propose(self, ids, k, cfg, generator):
        found: list[int] = []
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start:start + n] == tail:
                    found = ids[start + n:start + n + k]
                    break
            if found:
                break
        return Draft(torch.tensor(found[:k], dtype=torch.long), None)

    def commit(self, n_ids):
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

    def commit(self, n_ids):
        if self.copied:
            length, k = self.copied
            if n_ids - length - 1 < k / 2:  # fewer than half of the copied tokens accepted
                self.paused = self.pause
            self.copied = None
        self.model.commit(n_ids)


class EarlyExitDrafter(ModelDrafter):
    """Self-speculation: the target's first `layers` layers, its final norm and its head draft.

    The view shares every weight with the target, so no second model sits in memory.
    """

    name = "early-exit"

    def __init__(self, target, vocab: int, layers: int):
        super().__init__(CachedModel(truncated_view(target, layers), vocab))


def truncated_view(model: nn.Module, layers: int) -> nn.Module:
    """A shallow copy of a decoder-only HF model that runs only its first `layers` blocks."""
    inner = model.get_decoder()
    total = len(inner.layers)
    if not 1 <= layers < total:
        raise ValueError(f"early exit needs 1 <= layers < {total}, got {layers}")
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
