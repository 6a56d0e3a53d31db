"""Two attention functions registered with transformers, for the steps this project runs.

- "specdec_rows": for the exact int8 target (quant.quantise_target), a position's result must not depend
  on the pass it is in. Each query row is computed by the very call a one-token step makes: SDPA over
  exactly the keys that row may see (a chain row: the cache up to itself; a tree node: the cache before
  the tree and its own ancestors), its query heads stacked per key/value head. A verification pass then
  repeats, row by row, the arithmetic of plain decoding, in float32, at any context length.
- "specdec_grouped": grouped key/value heads without copying them per query head. Compiled decoding
  steps over a static cache always carry a mask, and transformers' SDPA path then repeats the key
  and value heads over the whole cache, every layer, every step (`repeat_kv`). Here each group's
  query heads are stacked along the query axis instead, so keys and values are read as they are.
"""
from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ROWS, GROUPED = "specdec_rows", "specdec_grouped"


def row_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, prompt_pass=False, **kwargs):
    """query [B, H, n, d]; key, value [B, Hkv, S, d]; attention_mask None (causal) or bool [B, 1, n, >= S].
    prompt_pass: the tokens are a prompt's. Plain and speculative decoding compute a prompt alike (one pass, then
    decode from its cache), so no position of it has to match a step, and one grouped call serves them all: a
    1,000-token prompt row by row would read keys 500,000 times a layer."""
    if prompt_pass:
        return grouped_attention(module, query, key, value, attention_mask, scaling=scaling)
    b, h, n, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    rows = []
    for i, seen in enumerate(visible_keys(attention_mask, n, s)):
        k, v = (key[:, :, :seen], value[:, :, :seen]) if isinstance(seen, int) else \
            (key.index_select(2, seen), value.index_select(2, seen))
        q = query[:, :, i].reshape(b, hkv, h // hkv, d)  # the query heads reading one key/value head, as rows
        rows.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scaling).reshape(b, 1, h, d))
    return torch.cat(rows, 1), None


_plans: dict = {}  # the last mask's key sets: every layer of a pass gets the same mask


def visible_keys(mask: torch.Tensor | None, n: int, s: int) -> list:
    """Per query row, the keys it may see: a count (the first ones) or the indices (a tree node's)."""
    if mask is None:  # causal: row i follows the s - n keys before the pass and the pass's first i
        return [s - n + i + 1 for i in range(n)]
    if _plans.get("mask", lambda: None)() is not mask or _plans["keys"] != s:
        plan = []
        for row in mask[0, 0, :, :s].tolist():
            count = row.index(False) if False in row else s
            plan.append(count if not any(row[count:]) else torch.tensor([j for j, x in enumerate(row) if x]))
        _plans.update(mask=weakref.ref(mask), keys=s, plan=plan)
    return _plans["plan"]


def grouped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [B, H, q, d]; key, value [B, Hkv, S, d], query head i reading key/value head i // (H / Hkv)."""
    b, h, q, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    g = h // hkv
    if attention_mask is None and q > 1:  # none given: causal as SDPA's is_causal is (query i sees keys 0..i)
        attention_mask = torch.ones(q, s, dtype=torch.bool, device=query.device).tril()[None, None]
    if attention_mask is not None:  # one row per query head of a group, each query's row repeated
        attention_mask = attention_mask[..., :s].unsqueeze(2).expand(b, attention_mask.shape[1], g, q, s)
        attention_mask = attention_mask.reshape(b, -1, g * q, s)
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(b, hkv, g * q, d), key, value,
                                                           attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, h, q, d).transpose(1, 2).contiguous(), None


for _name, _fn in ((ROWS, row_attention), (GROUPED, grouped_attention)):
    AttentionInterface.register(_name, _fn)
    AttentionMaskInterface.register(_name, sdpa_mask)
