"""The draft's decoding step on CPUs, written out in tensor operations.

A step of the 0.5B draft feeds one or two tokens through 24 layers. Its int4 products read the weights
once and are most of the time; the rest of transformers' general forward (module calls, a cache that
concatenates every layer's keys and values, casts, masks) costs a fifth of a step on two cores. Here a
Llama-shaped decoder (Qwen2, Llama) takes its step as one loop over its layers:
- the q/k/v products are one int4 product, and so are gate and up (their packed rows concatenated);
- keys and values are written into the room behind the cache's (cache.RoomLayer), not concatenated;
- the attention is one SDPA call per layer over the grouped key/value heads.

It serves the draft only. A draft changes the speed, never the output: its logits may differ from the
general forward's by rounding, and its tokens are verified by the target whatever they are.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import Int4Linear

class Int4Product:
    """One int4 product for several projections of the same input: their packed rows stacked, their outputs side
    by side. The kernel packs rows in blocks (64 on this CPU kernel), so stacking is exact only where each part
    fills whole blocks: checked here on a random input (`fused`), else the parts run one by one."""

    def __init__(self, linears: list[Int4Linear]):
        self.linears, self.in_features = linears, linears[0].packed.shape[1] * 2
        self.packed = torch.cat([m.packed for m in linears])
        self.scales = torch.cat([m.scales for m in linears], 1).contiguous()
        biases = [m.bias if m.bias is not None else self.scales.new_zeros(m.out_features) for m in linears]
        self.bias = torch.cat(biases) if any(m.bias is not None for m in linears) else None
        self.fused = True
        with torch.inference_mode():
            x = torch.randn(2, self.in_features, dtype=self.scales.dtype)
            self.fused = len(linears) == 1 or torch.equal(self(x), torch.cat([m(x) for m in linears], -1))
        if self.fused:
            start = 0
            for m in linears:  # each projection keeps its rows, now a view of the stacked ones (not a second copy)
                m.packed, start = self.packed[start:start + m.packed.shape[0]], start + m.packed.shape[0]
        else:
            self.packed = self.scales = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return torch.cat([m(x) for m in self.linears], -1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.linears[0].GROUP, self.scales)
        return y if self.bias is None else y + self.bias


class DecodeStep:
    """fits(model): a Llama-shaped decoder on a CPU with int4 projections. step(ids, cache, length, keep):
    append `ids` [1, n] to `cache` (a DynamicCache holding `length` tokens) and return the logits of the
    last `keep` positions, [keep, vocab]; None when the cache is not ready for it (nothing cached yet)."""

    def __init__(self, model):
        cfg = model.config
        self.model, self.eps = model, cfg.rms_norm_eps
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hidden = cfg.hidden_size
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden // self.heads
        self.layers = []
        for layer in model.get_decoder().layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append((layer.input_layernorm.weight, Int4Product([a.q_proj, a.k_proj, a.v_proj]),
                                Int4Product([a.o_proj]), layer.post_attention_layernorm.weight,
                                Int4Product([m.gate_proj, m.up_proj]), Int4Product([m.down_proj]), a.scaling))

    @staticmethod
    def fits(model) -> bool:
        cfg = model.config
        layers = model.get_decoder().layers
        attn, mlp = layers[0].self_attn, layers[0].mlp
        return (model.get_input_embeddings().weight.device.type == "cpu" and cfg.model_type in ("qwen2", "llama")
                and not getattr(cfg, "use_sliding_window", False) and getattr(cfg, "hidden_act", "silu") == "silu"
                and all(isinstance(getattr(part, name), Int4Linear) for part, names in (
                    (attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, ("gate_proj", "up_proj", "down_proj")))
                    for name in names))

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, cache, length: int, keep: int) -> torch.Tensor | None:
        if length == 0 or len(cache.layers) != len(self.layers) or not cache.layers[0].is_initialized:
            return None
        n, end, d, g = ids.shape[1], length + ids.shape[1], self.head_dim, self.heads // self.kv_heads
        h = self.model.get_input_embeddings()(ids[0])  # [n, hidden]
        positions = torch.arange(length, end, device=ids.device)[None]
        cos, sin = (c[0] for c in self.model.get_decoder().rotary_emb(h[None], positions))  # [n, d]
        # n > 1: query i sees the cache and the new tokens up to itself; rows ordered as the grouped query heads
        mask = None if n == 1 else torch.ones(n, end, dtype=torch.bool).tril(length).repeat(g, 1)[None, None]
        rotate = lambda x: x * cos + torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1) * sin
        for layer, (norm1, qkv, out, norm2, gate_up, down, scale) in zip(cache.layers, self.layers):
            x = qkv(F.rms_norm(h, (self.hidden,), norm1, self.eps)).view(n, -1, d).transpose(0, 1)  # [heads', n, d]
            q, k = rotate(x[: self.heads + self.kv_heads]).split((self.heads, self.kv_heads))  # one rotation for both
            keys, values = layer.update(k[None], x[None, self.heads + self.kv_heads:])
            # each key/value head's query heads stacked as rows: the keys are read as they are, not repeated
            o = F.scaled_dot_product_attention(q.reshape(1, self.kv_heads, g * n, d), keys, values,
                                               attn_mask=mask, scale=scale)
            h = h + out(o.view(self.heads, n, d).transpose(0, 1).reshape(n, -1))
            x = gate_up(F.rms_norm(h, (self.hidden,), norm2, self.eps))
            h = h + down(F.silu(x[:, : x.shape[1] // 2]) * x[:, x.shape[1] // 2:])
        norm = self.model.get_decoder().norm
        return self.model.get_output_embeddings()(F.rms_norm(h[n - keep:], (self.hidden,), norm.weight, self.eps))
