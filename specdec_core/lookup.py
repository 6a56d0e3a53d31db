"""Drafters that look back instead of running a model: prompt lookup (what followed the latest earlier occurrence of
the last few tokens), and the hybrid that copies so while the text is being copied and asks the draft model
otherwise."""
from __future__ import annotations

import torch

from .drafts import Draft


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
        return iter(())

    def propose(self, ids, k, cfg, generator):
        return Draft(torch.tensor(self.ngrams.after(ids, ids, k)[1], dtype=torch.long), None)


class HybridDrafter:
    """Prompt lookup when the text is being copied (a full k-token continuation of an earlier
    n-gram), the draft model otherwise. A copied round costs no draft steps at all; the model's
    cache catches up on the tokens it skipped the next time it drafts. A copy that the target
    mostly rejects (the text changes where it was copied from, as in a rename) sends the next
    `pause` rounds to the model."""

    name = "hybrid"

    def __init__(self, model, min_ngram: int = 3, pause: int = 2):
        self.model, self.lookup = model, PromptLookupDrafter(max_ngram=min_ngram, min_ngram=min_ngram)
        self.pause, self.paused, self.copied = pause, 0, None  # copied: (sequence length, k) of the last copy

    def start(self, ids):
        self.paused, self.copied = 0, None
        return self.model.start(ids)

    def propose(self, ids, k, cfg, generator):
        if self.copied:  # the last round's copy: mostly rejected, the next rounds go to the model
            length, copied_k = self.copied
            if len(ids) - length - 1 < copied_k / 2:  # fewer than half of the copied tokens accepted
                self.paused = self.pause
            self.copied = None
        if self.paused:
            self.paused -= 1
        else:
            copied = self.lookup.propose(ids, k, cfg, generator)
            if len(copied) == k:
                self.copied = (len(ids), k)
                return copied
        return self.model.propose(ids, k, cfg, generator)
