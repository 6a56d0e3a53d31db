"""Two attention functions registered with transformers, for the steps this project runs.

- "specdec_float64": SDPA in float64, for the int8 target (quant.quantise_target): a row's result
  must not depend on how many rows its pass has, and in float64 the summation-order differences
  between a 1-row and a 17-row pass stay below every int8 rounding step.
- "specdec_grouped": grouped key/value heads without copying them per query head. Compiled decoding
  steps over a static cache always carry a mask, and transformers' SDPA path then repeats the key
  and value heads over the whole cache, every layer, every step (`repeat_kv`). Here each group's
  query heads are stacked along the query axis instead, so keys and values are read as they are.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

FLOAT64, GROUPED = "specdec_float64", "specdec_grouped"


def float64_attention(module, query, key, value, attention_mask, **kwargs):
    out, weights = sdpa_attention_forward(module, query.double(), key.double(), value.double(), attention_mask, **kwargs)
    return out.to(query.dtype), weights


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


for _name, _fn in ((FLOAT64, float64_attention), (GROUPED, grouped_attention)):
    AttentionInterface.register(_name, _fn)
    AttentionMaskInterface.register(_name, sdpa_mask)
