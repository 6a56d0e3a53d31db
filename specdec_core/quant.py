"""Making the draft cheaper. The target verifies every token, so the draft's precision and vocabulary
change only how many drafts are accepted, never the output.

- int8 weight-only quantisation with one scale per output channel (activations stay bfloat16/float32,
  so it is far gentler than dynamic per-tensor quantisation), through PyTorch's own
  `_weight_int8pack_mm` kernel: no extra dependency.
- a head restricted to the first `keep` token ids (byte-level BPE ids are roughly in merge order, so
  low ids are the frequent tokens); q is renormalised over that subset and is exactly what is sampled.
"""
from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(linear.weight.dtype))
        self.bias = linear.bias
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.weight, self.scales.to(x.dtype))
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class PrunedHead(nn.Module):
    """An output head over the first `keep` token ids; the other logits are -inf (q = 0 there)."""

    def __init__(self, head: nn.Linear, keep: int, vocab: int):
        super().__init__()
        self.head = nn.Linear(head.in_features, keep, bias=False, dtype=head.weight.dtype, device=head.weight.device)
        self.head.weight = nn.Parameter(head.weight.detach()[:keep].clone(), requires_grad=False)
        self.vocab = vocab

    @property
    def weight(self):  # callers read the output size from the head's weight
        return torch.empty((self.vocab, self.head.in_features), device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = self.head(x)
        out = torch.full((*kept.shape[:-1], self.vocab), float("-inf"), dtype=kept.dtype, device=kept.device)
        out[..., : kept.shape[-1]] = kept
        return out


def cheapen_draft(model: nn.Module, int8: bool = True, keep_vocab: int = 0) -> nn.Module:
    """In place: int8 weight-only Linear layers and/or a pruned head. Returns the model."""
    head = model.get_output_embeddings()
    if keep_vocab:
        pruned = PrunedHead(head, keep_vocab, head.weight.shape[0])
        model.set_output_embeddings(pruned)
        model.config.tie_word_embeddings = False
    if int8:
        targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
        for name, mod in targets:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, Int8Linear(mod))
    return model
