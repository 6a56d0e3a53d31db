"""Two attention functions registered with transformers, for the steps this project runs.

- "specdec_rows": for the exact int8 target (quant.quantise_target), a position's result must not depend
  on the pass it is in. Every row, a one-token step's or a verification pass's, goes through one kernel:
  it reads the keys that row may see (a chain row: the cache up to itself; a tree node: the cache before
  the tree and its own ancestors) padded to a multiple of BLOCK positions, the padding masked out. Rows
  of equal width share a matrix product, each row's query heads stacked per key/value head; an entry of
  a product does not depend on how many rows it holds (probed: where it does, each row gets a product of
  its own), so a pass repeats plain decoding's arithmetic, in float32, at any context length, and reads
  the keys once per width, not once per row.
- "specdec_grouped": grouped key/value heads without copying them per query head, for the draft on CPUs
  (its prompts and trees; its steps over long contexts do the same in step.py). Given a mask, transformers' SDPA
  path repeats the key and value heads over the whole cache, every layer, every step (`repeat_kv`). Here each
  group's query heads are stacked along the query axis instead, so keys and values are read as they are.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ROWS, GROUPED = "specdec_rows", "specdec_grouped"


def row_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, prompt_pass=False, **kwargs):
    """query [B, H, n, d]; key, value [B, Hkv, S, d]; attention_mask None (causal) or bool [B, 1, n, >= S].
    prompt_pass: the tokens are a prompt's. Plain and speculative decoding compute a prompt alike (one pass, then
    decode from its cache), so no position of it has to match a step, and one grouped call serves them all."""
    if prompt_pass:
        return grouped_attention(module, query, key, value, attention_mask, scaling=scaling)
    b, h, n, d = query.shape
    hkv = key.shape[1]
    q = (query * (d ** -0.5 if scaling is None else scaling)).view(b * hkv, h // hkv, n, d)
    q = q.transpose(1, 2)  # per key/value head: n rows of its query heads
    # rows of a pass whose batched sums would differ from a step's get a product each (a step's one row needs no probe)
    alone = n > 1 and not rows_agree(b * hkv, h // hkv, d, query.device, query.dtype)
    groups = {}  # rows by the width of their keys and whether they read the cache's first keys or others
    for i, seen in enumerate(visible_keys(attention_mask, n, key.shape[2])):
        count = seen if isinstance(seen, int) else len(seen)
        groups.setdefault((-(-count // BLOCK) * BLOCK, isinstance(seen, int), i if alone else 0), []).append((i, seen))
    out = q.new_empty(q.shape) if len(groups) > 1 else None
    for (width, cached, _), rows in groups.items():
        idx, seen = zip(*rows)
        if cached:
            k, v = (widened(t, width).reshape(b * hkv, width, d) for t in (key, value))
            counts = list(seen)
        else:  # a tree node's keys, in order, then (weightless) copies of the first
            at = torch.stack([F.pad(s, (0, width - len(s))) for s in seen]).view(-1)
            k, v = (t.index_select(2, at).view(b * hkv, len(idx), width, d) for t in (key, value))
            counts = [len(s) for s in seen]
        if out is None:  # one group: every row, in order
            out = attend(q, k, v, counts)
        else:
            out[:, list(idx)] = attend(q[:, list(idx)], k, v, counts)
    return out.view(b, hkv, n, -1, d).transpose(1, 2).reshape(b, n, h, d), None


BLOCK = 64  # a row's keys are padded to a multiple of this: a step and a pass row of one width compute alike
MIN_ROWS = 4  # MKL computes a product of fewer rows with other kernels (other sums): a step's are padded to it


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """q [B, m, g, d], scaled: m rows of g query heads each; k, v [B, P, d], read by every row, or [B, m, P, d], a
    set per row; row r sees the first counts[r] of its P keys. The keys past them get no weight (their values must
    be finite: 0 × a value). Returns [B, m, g, d]."""
    b, m, g, d = q.shape
    width = k.shape[-2]
    if k.dim() == 3:  # one product of all m × g rows
        q = q.reshape(b, m * g, d)
    else:  # a product per row, of its g query heads
        q, k, v = q.reshape(b * m, g, d), k.reshape(b * m, width, d), v.reshape(b * m, width, d)
    rows = q.shape[1]
    if rows < MIN_ROWS:
        q = F.pad(q, (0, 0, 0, MIN_ROWS - rows))
    scores = torch.bmm(q, k.transpose(1, 2))
    lo = min(counts)
    if lo < width:  # the keys past a row's own get no weight
        past = scores[:, :rows, lo:].view(b, m, g, width - lo)
        if len(set(counts)) == 1:
            past.fill_(float("-inf"))
        else:
            past.masked_fill_((torch.arange(lo, width) >= torch.tensor(counts)[:, None])[:, None].to(q.device),
                              float("-inf"))
    return torch.bmm(scores.softmax(-1), v)[:, :rows].reshape(b, m, g, d)


_agrees: dict = {}  # rows_agree's answers, by the shapes and type of the products


def rows_agree(b: int, g: int, d: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `attend` gives a row the same bits alone, as a step computes it, and among the rows of a pass: up to
    65 of them, reading one range of keys or keys gathered per row. Batching a pass's rows relies on it. MKL's
    products do so here from MIN_ROWS rows up, for 2 key/value heads but not for 1 (a batch of one product); where
    this probe on random numbers (once per shape, at two key widths) finds otherwise, each row gets a product of
    its own, as a step does."""
    key = (device.type, dtype, b, g, d)
    if key not in _agrees:
        gen, agree = torch.Generator().manual_seed(0), True
        for width in (BLOCK, 17 * BLOCK):
            q, k, v = (torch.randn(size, generator=gen).to(device, dtype)
                       for size in ((b, 65, g, d), (b, width, d), (b, width, d)))
            counts = [width - i % BLOCK for i in range(65)]
            steps = torch.cat([attend(q[:, i:i + 1], k, v, counts[i:i + 1]) for i in range(65)], 1)
            for m in (2, 5, 17, 65):
                per_row = [t[:, None].expand(b, m, width, d) for t in (k, v)]  # a tree's layout
                agree &= torch.equal(attend(q[:, :m], k, v, counts[:m]), steps[:, :m]) and \
                    torch.equal(attend(q[:, :m], *per_row, counts[:m]), steps[:, :m])
        _agrees[key] = agree
    return _agrees[key]


def widened(t: torch.Tensor, width: int) -> torch.Tensor:
    """The first `width` positions of keys or values t [B, Hkv, S, d]: a view into the buffer behind t
    where it has the room (a RoomLayer's: finite entries past S), else t padded with zeros."""
    b, h, s, d = t.shape
    if width <= s:
        return t[:, :, :width]
    st = t.stride()
    end = t.storage_offset() + (b - 1) * st[0] + (h - 1) * st[1] + width * d
    if st[3] == 1 and st[2] == d and st[1] >= width * d and st[0] >= h * st[1] \
            and end * t.element_size() <= t.untyped_storage().nbytes():
        return t.as_strided((b, h, width, d), st)
    return F.pad(t, (0, 0, 0, width - s))


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
    out = F.scaled_dot_product_attention(query.reshape(b, hkv, g * q, d), key, value,
                                         attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, h, q, d).transpose(1, 2).contiguous(), None


for _name, _fn in ((ROWS, row_attention), (GROUPED, grouped_attention)):
    AttentionInterface.register(_name, _fn)
    AttentionMaskInterface.register(_name, sdpa_mask)
