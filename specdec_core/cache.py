"""A causal LM together with its KV cache and the one number that matters: how many tokens it holds."""
from __future__ import annotations

import copy
import warnings
import weakref
from typing import Iterator

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer

from .events import tree_depths
from .transfer import upload

PADDED_SIZES = (1, 2, 4, 8, 16, 32)  # compiled input sizes: a short input is padded up to the next one
ROOM = 256  # positions a growing cache allocates at least
PROMPT_CHUNK = 256  # a prompt runs in passes of at most this many tokens (CachedModel.prefill)


def padded_size(n: int) -> int:
    """The compiled input size that an input of n tokens (n <= PADDED_SIZES[-1]) is padded up to."""
    return next(s for s in PADDED_SIZES if s >= n)


class RoomLayer(DynamicLayer):
    """One layer's keys and values, written into buffers with room behind them. transformers' DynamicLayer
    concatenates the whole cache with every new token: at 1,000 tokens of context a step of the 1.5B target
    copied 57 MB for that. Here a step writes its own entries; a crop is a shorter view of the same buffer. The room
    holds zeros or rolled-back entries, never NaN: the exact target's attention reads it with weight 0."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.buffers = {}
        length = self.get_seq_length()
        self.keys, self.values = self.grown("keys", key_states, length), self.grown("values", value_states, length)
        return self.keys, self.values

    def reserve(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for `n` more entries, written by the caller (step.py): the key and value buffers, [B, heads, room, d],
        contiguous; the layer's keys and values become their first length + n entries."""
        length = self.get_seq_length()
        bases = tuple(self.buffer(name, getattr(self, name), length, length + n) for name in ("keys", "values"))
        self.keys, self.values = (base[:, :, :length + n] for base in bases)
        return bases

    def grown(self, name: str, new: torch.Tensor, length: int) -> torch.Tensor:
        """The layer's first `length` keys or values followed by `new`."""
        end = length + new.shape[-2]
        base = self.buffer(name, new, length, end)
        base[:, :, length:end] = new
        return base[:, :, :end]

    def buffer(self, name: str, like: torch.Tensor, length: int, end: int) -> torch.Tensor:
        """A buffer for `end` keys or values that starts with the layer's first `length`: this layer's own while they
        are still its start (else, as after a copy of the cache, a new one)."""
        now, base = getattr(self, name), self.buffers.get(name)
        if base is None or base.shape[-2] < end or base.data_ptr() != now.data_ptr() or base.stride() != now.stride():
            base = self.buffers[name] = like.new_zeros(*like.shape[:2], max(2 * end, ROOM), like.shape[-1])
            if length:
                base[:, :, :length] = now[:, :, :length]
        return base


def room_cache(model) -> DynamicCache:
    """A DynamicCache for `model` whose full-attention layers are RoomLayers (sliding-window ones stay as they are)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [RoomLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class SharedHead:
    """Tokens that every prompt starts with (a chat template's system block) and, once computed,
    their keys and values: later prompts copy them instead of running the model over them again."""

    def __init__(self, ids: list[int], model):
        self.ids, self.model, self.cache = list(ids), model, None


class CompiledForward:
    """Fixed-size caches and a compiled forward for short inputs, for GPUs: a small model's step is hundreds of kernel
    launches, and one replay with CUDA graphs. Graphs need fixed shapes and addresses, so the caches (`max_len`
    positions) are preallocated and pooled, and inputs padded to a PADDED_SIZES size: padded keys sit past the
    committed length, where no query looks, and are overwritten next. Prompts and tree passes run uncompiled.
    `width`: every decoding forward fed at this many rows, so that a row is computed by the same kernels in a step
    and in a chain's pass (kernels for other row counts may sum in another order, and near-ties part with them)."""

    def __init__(self, model, max_len: int, backend: str = "inductor", width: int | None = None):
        self.model, self.max_len, self.width = model, max_len, width
        self.free: list[StaticCache] = []
        kw = {"mode": "reduce-overhead"} if backend == "inductor" else {}
        self.compiled = torch.compile(model.forward, backend=backend, dynamic=False, **kw)
        # one compiled entry per (model, padded size, cache); the default limit of 8 is soon reached
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

    def acquire(self) -> StaticCache:
        if self.free:
            return self.free.pop()
        cfg = self.model.config.get_text_config(decoder=True)
        cache = StaticCache(config=cfg, max_cache_len=self.max_len)
        weight = self.model.get_input_embeddings().weight
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        cache.early_initialization(1, cfg.num_key_value_heads, head_dim, weight.dtype, weight.device)
        return cache

    @staticmethod
    def set_length(cache: StaticCache, length: int) -> None:
        for layer in cache.layers:
            layer.cumulative_length.fill_(length)


class TreeInput:
    """Tokens fed as nodes of a tree: each sees the cache before the tree and its own ancestors.

    `parents[i]`: the index of node i's parent among the tree's nodes (-1: it follows the cache directly);
    `fed`: how many of the tree's earlier nodes already sit in the cache (the last `fed` entries), fed
    by earlier calls, so a tree can be grown a level at a time. Parents come before their children.
    """

    def __init__(self, parents: list[int], fed: int = 0):
        self.parents, self.fed = list(parents), fed
        self.depth = [d - 1 for d in tree_depths(self.parents)]  # 0: right after the cache

    def model_inputs(self, length: int, attention: str, device, width: int | None = None) -> dict:
        """Position ids and the attention mask for the unfed nodes, after `length` cached entries;
        `width`: the mask's number of key positions (a static cache's size), length + nodes by default."""
        n, m = len(self.parents) - self.fed, len(self.parents)
        base = length - self.fed  # where the tree's first node sits
        sees = torch.eye(m, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                sees[i] |= sees[p]
        mask = torch.zeros(n, width or length + n, dtype=torch.bool)
        mask[:, :base] = True
        mask[:, base:length + n] = sees[self.fed:]
        positions = torch.tensor([base + d for d in self.depth[self.fed:]])
        if attention == "eager":  # eager attention adds its mask; the SDPA family takes booleans
            mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
        return {"attention_mask": upload(mask[None, None], device), "position_ids": upload(positions[None], device)}


class CachedModel:
    """Position-indexed state: the cache holds exactly the first `length` committed tokens.

    Rolling back after a rejection is `crop(length)`; nothing before it is ever recomputed.
    `static`: the model's compiled steps (a pooled static cache is used); `head`: the prompt head it shares;
    `step`: a written-out forward of its own (models/step.py), step(ids, cache, length, keep, tree, prompt, skip) ->
    logits, or None where the general forward is to take it. `skip`: token ids [lo, hi) its steps may leave out of the
    head (models.step.DraftStep), set by the drafter.
    """

    def __init__(self, model, vocab: int, static: CompiledForward | None = None, head: SharedHead | None = None,
                 written=None):
        self.model, self.vocab, self.written = model, vocab, written
        self.skip: tuple[int, int] | None = None
        self.device = model.get_input_embeddings().weight.device
        self.static = static
        self.head = None if static else head  # a static cache's keys sit in fixed buffers: nothing to copy in
        if self.static:  # the cache goes back to the pool when this object goes
            self.cache = self.static.acquire()
            weakref.finalize(self, self.static.free.append, self.cache)
        self.reset()

    def reset(self) -> None:
        if self.static:
            self.static.set_length(self.cache, 0)
        else:
            self.cache = room_cache(self.model)
        self.length = 0

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, keep: int, prompt: bool = False, tree: TreeInput | None = None) -> torch.Tensor:
        """Append `ids` to the cache; return the logits of the last `keep` positions, [keep, vocab].
        `prompt`: a prompt's tokens (run uncompiled), not a decoding step (compiled, when the model has CompiledForward).
        `tree`: the tokens are nodes of a token tree (positions and visibility from it), not a sequence."""
        n = ids.numel()
        ids = ids.view(1, -1).to(self.device)
        if self.static and self.length + n + PADDED_SIZES[-1] > self.static.max_len:
            raise ValueError(f"The sequence would exceed the static cache of {self.static.max_len} positions.")
        logits = None
        if self.static and self.static.compiled and tree is None and not prompt and n <= PADDED_SIZES[-1]:
            logits = self._compiled_forward(ids, keep)
        elif self.written and not self.static:
            logits = self.written(ids, self.cache, self.length, keep, tree, prompt, self.skip)
        if logits is None:  # a prompt is said so to the attention (attention.row_attention)
            inputs = tree.model_inputs(self.length, self.model.config._attn_implementation, self.device,
                                       self.static.max_len if self.static else None) if tree is not None else {}
            out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=keep,
                             **inputs, **({"prompt_pass": True} if prompt else {}))
            logits = out.logits[0]
        self.length += n
        # rows past the shared tokenizer range (vocab padding) are never sampled
        return logits[:, : self.vocab]

    def _compiled_forward(self, ids: torch.Tensor, keep: int) -> torch.Tensor | None:
        n = ids.shape[1]
        size = self.static.width or padded_size(n)
        padded = torch.cat([ids, ids.new_zeros(1, size - n)], 1)
        try:
            torch.compiler.cudagraph_mark_step_begin()
            out = self.static.compiled(input_ids=padded, past_key_values=self.cache, use_cache=True)
        except Exception as err:  # a compiler that fails here must not end the run: go on uncompiled
            warnings.warn(f"compiled decoding step failed, running uncompiled from now on: {err!r:.300}")
            self.static.compiled = None
            self.static.set_length(self.cache, self.length)
            return None
        self.static.set_length(self.cache, self.length + n)  # the padding does not count
        return out.logits[0, n - keep: n].clone()  # a graph's output is overwritten by its next replay

    def prefill(self, ids: list[int]) -> None:
        """Append a prompt's tokens (prefill_chunks, run through)."""
        for _ in self.prefill_chunks(ids):
            pass

    def prefill_chunks(self, ids: list[int]) -> Iterator[int]:
        """Append a prompt's tokens, yielding how many are in after each pass, so that a long prompt can be stopped
        between them. A long one runs in passes of PROMPT_CHUNK tokens: in one pass over 3,000 tokens every product
        and activation of the 1.5B target is a fresh tensor of 100 MB, whose new pages cost a CPU more than the
        arithmetic. Plain and speculative decoding both prefill here, so their caches stay the same."""
        head, n = self.head, len(ids)
        if head and self.length == 0 and ids[: len(head.ids)] == head.ids:
            # the head's keys and values do not depend on what follows it: computed once, then copied
            if head.cache is None:
                self.forward(upload(head.ids, self.device), keep=1, prompt=True)
                head.cache = copy.deepcopy(self.cache)
            else:
                self.cache, self.length = copy.deepcopy(head.cache), len(head.ids)
            ids = ids[len(head.ids):]
            yield n - len(ids)
        for start in range(0, len(ids), PROMPT_CHUNK):
            self.forward(upload(ids[start:start + PROMPT_CHUNK], self.device), keep=1, prompt=True)
            yield n - len(ids) + min(start + PROMPT_CHUNK, len(ids))

    @torch.inference_mode()
    def compact(self, start: int, kept: list[int]) -> None:
        """Keep, of the entries from `start` on, those at offsets `kept` (increasing), moved to start,
        start + 1, ...: a token tree's accepted path, its other branches dropped."""
        if kept != list(range(len(kept))):
            src = upload([start + i for i in kept], self.device)
            for layer in self.cache.layers:
                for name in ("keys", "values"):
                    t = getattr(layer, name)
                    t[:, :, start:start + len(kept)] = t.index_select(2, src.to(t.device, non_blocking=True))
        self.crop(start + len(kept))

    def crop(self, length: int) -> None:
        if length < self.length:
            if self.static:  # stale keys past `length` are masked, then overwritten
                self.static.set_length(self.cache, length)
            else:
                self.cache.crop(length - self.length)  # transformers 5: a negative count of tokens to drop
            self.length = length

    def check(self) -> None:
        """The cache holds exactly `length` tokens. A static cache keeps its length on the device, where reading
        it would stall a GPU round: that one is left to the tests."""
        if self.static is None:
            assert self.cache.get_seq_length() == self.length, (self.cache.get_seq_length(), self.length)
