"""A causal LM together with its KV cache and the one number that matters: how many tokens it holds."""
from __future__ import annotations

import torch
from transformers import DynamicCache


class CachedModel:
    """Position-indexed state: the cache holds exactly the first `length` committed tokens.

    Rolling back after a rejection is `crop(length)`; nothing before it is ever recomputed.
    """

    def __init__(self, model, vocab: int):
        self.model, self.vocab = model, vocab
        self.device = model.get_input_embeddings().weight.device
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.length = 0

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, keep: int) -> torch.Tensor:
        """Append `ids` to the cache; return the logits of the last `keep` positions, [keep, vocab]."""
        out = self.model(input_ids=ids.view(1, -1).to(self.device), past_key_values=self.cache,
                         use_cache=True, logits_to_keep=keep)
        self.length += ids.numel()
        # rows past the shared tokenizer range (vocab padding) are never sampled
        return out.logits[0, :, : self.vocab]

    def prefill(self, ids: list[int]) -> None:
        if ids:
            self.forward(torch.tensor(ids, device=self.device), keep=1)

    def crop(self, length: int) -> None:
        if length < self.length:
            self.cache.crop(length - self.length)  # transformers 5: a negative count of tokens to drop
            self.length = length

    def check(self) -> None:
        assert self.cache.get_seq_length() == self.length, (self.cache.get_seq_length(), self.length)
