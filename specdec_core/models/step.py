"""The decoding forwards on CPUs, written out: the int4 draft's steps, and the exact target's every forward.

A Llama-shaped decoder (Qwen2, Llama) runs as one loop over its layers, where transformers' general forward spends a
large share of a small step on module calls, casts, masks and a cache that concatenates: q/k/v are one product and
gate/up another; the small operations between products are one step_ops.c call each; keys and values are written
into the room behind the cache (cache.RoomLayer); and a forward of n rows is a Plan, its calls bound once over
buffers of its own, so that a step sets only what changes.

DraftStep (int4, bfloat16) takes the draft's steps of one or a few tokens and its short prompts (on the int8 twins from
Int4Linear.WIDE rows, as its general forward), its attention step_ops.c's (PyTorch's past OWN_ATTENTION_MOST
positions); its long prompts and its trees take the general forward. A draft changes the speed, never the output.
TargetForward (the GGUF blocks, float32) takes every forward of the target, and computes each row alone, its
attention too (kquant.c's rows_attention), so that a position's logits are the same bits in a step and in any pass. A
prompt's rows are one grouped attention call: plain and speculative decoding compute a prompt alike.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import threading
import types

import torch
import torch.nn.functional as F

from ..cache import RoomLayer, TreeInput
from ..config import MAX_K
from .attention import row_attention
from .kernels import int4_vnni
from .kernels.int4_vnni import product as int4_product
from .kernels.kquant import KQuantLinear, visible
from .kernels.kquant import library as kquant_library
from .kernels.step_ops import ops
from .quant import Int4Linear

PLANNED = MAX_K + 1  # forwards of up to this many rows keep their plans: a step, a chain's pass, a tree's level
OWN_ATTENTION_MOST = 512  # the most positions the draft's steps attend to with step_ops.c's attention
DRAFT_ROWS_MOST = 64  # the most rows of a draft's forward written out: a longer prompt takes the general forward


class Plan:
    """A forward of n rows as calls in order, each (function, its bound arguments, whether a non-zero result means no
    memory), the buffers they write, and the ctypes values they were bound to that each forward sets anew: the
    residual stream, the rotation's rows, the cache's length, the rows' visible keys, each layer's key and value
    buffers with their room and stride. `cache`: the cache's layers and mask, for the attention in PyTorch (held
    apart, so that no call refers back to its plan: a plan that is not kept is freed at once, buffers and all)."""

    def __init__(self, layers: int):
        p = ctypes.c_void_p
        self.calls, self.buffers, self.x, self.cache = [], {}, None, types.SimpleNamespace(layers=None, mask=None)
        self.h, self.cos, self.sin, self.counts, self.idx = p(), p(), p(), p(), p()
        self.length, self.width = ctypes.c_int(), ctypes.c_int()
        self.cache_views = [(p(), p(), ctypes.c_int(), ctypes.c_long()) for _ in range(layers)]

    def buffer(self, name: str, rows: int, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The buffer `name` of this shape, one for all layers: each layer's calls write it after the last reader of
        the layer before (a prompt's plan of 256 rows holds one layer's, 40 MB on the bundled target, not 28)."""
        key = (name, rows, width, dtype)
        if key not in self.buffers:
            self.buffers[key] = torch.empty(rows, width, dtype=dtype)
        return self.buffers[key]

    def add(self, call, *args, checked: bool = False) -> None:
        self.calls.append((call, args, checked))

    def run(self, call) -> None:
        self.calls.append((call, (), False))


class Int4Product:
    """One int4 product for several projections of the same input: their weights stacked, their outputs side by
    side. Stacking is exact only where each part fills whole blocks of the kernel's layout (4 outputs in int4_vnni's,
    64 in PyTorch's CPU kernel): checked here on a random input (`fused`), else the parts run one by one."""

    def __init__(self, linears: list[Int4Linear]):
        self.linears, self.in_features = linears, linears[0].in_features
        self.out_features = sum(m.out_features for m in linears)
        self.own = linears[0].tiles is not None
        names = ("tiles",) if self.own else ("packed",)
        self.stacked = {name: torch.cat([getattr(m, name) for m in linears]) for name in names}
        if not self.own:
            self.stacked["scales"] = torch.cat([m.scales for m in linears], 1).contiguous()
        biases = [m.bias if m.bias is not None else torch.zeros(m.out_features, dtype=torch.bfloat16) for m in linears]
        self.bias = torch.cat(biases).to(torch.bfloat16) if any(m.bias is not None for m in linears) else None
        self.fused = True
        with torch.inference_mode():
            x = torch.randn(2, self.in_features, dtype=torch.bfloat16)
            self.fused = len(linears) == 1 or torch.equal(self(x), torch.cat([m(x) for m in linears], -1))
        if self.fused:
            start = 0
            for m in linears:  # each projection keeps its weights, now a view of the stacked ones (not a second copy)
                for name in names:
                    size = getattr(m, name).shape[0]
                    setattr(m, name, self.stacked[name][start:start + size])
                start += size
        else:
            self.stacked = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return torch.cat([m(x) for m in self.linears], -1)
        if self.own:
            y = int4_product(self.stacked["tiles"], x, self.out_features, self.in_features)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.stacked["packed"], Int4Linear.GROUP,
                                                           self.stacked["scales"])
        return y if self.bias is None else y + self.bias

    def bind(self, plan: Plan, x: torch.Tensor, name: str) -> torch.Tensor:
        """This product of x's rows as the plan's calls, into its buffer `name`, which it returns: from Int4Linear.WIDE
        rows on (a prompt), each layer's own forward, which takes its int8 twin there."""
        n, y = len(x), plan.buffer(name, len(x), self.out_features, torch.bfloat16)
        if n >= Int4Linear.WIDE:
            plan.run(lambda: torch.cat([m(x) for m in self.linears], -1, out=y))
            return y
        if not (self.fused and self.own):
            plan.run(lambda: y.copy_(self(x)))
            return y
        plan.add(int4_vnni.library()[0].int4_vnni_mm, self.stacked["tiles"].data_ptr(), x.data_ptr(), n, self.out_features,
                 self.in_features, None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
                 torch.get_num_threads(), checked=True)
        return y


class KQuantProduct:
    """Several projections on GGUF blocks of one input: one product for each run of one kind, their packed weights
    concatenated (packed side by side at load, gguf_model.load_target: joined where they lie). A group of 16 outputs
    is computed alone (kquant.c), so each output is the same bits either way."""

    def __init__(self, linears: list[KQuantLinear]):
        self.runs = []
        for kind, run in itertools.groupby(linears, key=lambda m: m.kind):
            run = list(run)
            parts = [m.packed for m in run]
            beside = all(a.data_ptr() + a.numel() == b.data_ptr() and a.untyped_storage().data_ptr()
                         == b.untyped_storage().data_ptr() for a, b in zip(parts, parts[1:]))
            packed = parts[0].as_strided((sum(p.numel() for p in parts),), (1,)) if beside else torch.cat(parts)
            biases = [m.bias if m.bias is not None else torch.zeros(m.out_features) for m in run]
            bias = torch.cat(biases) if any(m.bias is not None for m in run) else None
            start = 0
            for m in run:  # each projection keeps its weights, now a view of the concatenated ones
                m.packed, start = packed[start:start + m.packed.numel()], start + m.packed.numel()
            self.runs.append((kind, packed, bias, sum(m.out_features for m in run)))

    def bind(self, plan: Plan, x: torch.Tensor, name: str) -> torch.Tensor:
        """As Int4Product.bind. One row's outputs of each run lie side by side; several rows' are joined after."""
        n, y = len(x), plan.buffer(name, len(x), sum(outputs for *_, outputs in self.runs))
        joined = len(self.runs) > 1 and n > 1  # each run's rows into a buffer of their own, joined after
        parts = [plan.buffer(f"{name} {j}", n, run[-1]) for j, run in enumerate(self.runs)] if joined else []
        start = 0
        for j, (kind, packed, bias, outputs) in enumerate(self.runs):
            into = parts[j].data_ptr() if joined else y.data_ptr() + 4 * start  # one row: the runs side by side
            plan.add(kquant_library()[0].kquant_mm, packed.data_ptr(), kind, None if bias is None else bias.data_ptr(),
                     x.data_ptr(), n, outputs, x.shape[1], into, torch.get_num_threads(), checked=True)
            start += outputs
        if joined:
            plan.run(functools.partial(torch.cat, parts, -1, out=y))
        return y


class WrittenForward:
    """A Llama-shaped decoder's forwards on a CPU, written out (TargetForward, DraftStep: which projections and which
    activations). fits(model): its projections are of this kind, where step_ops.c builds.
    __call__(ids, cache, length, keep, tree=None, prompt=False): append `ids` [1, n] to `cache` (a DynamicCache of
    RoomLayers holding `length` tokens) and return the logits of the last `keep` positions, [keep, vocab]; None
    where the general forward is to take it."""

    projection, product, dtype, suffix = None, None, None, ""  # a subclass's: the layers' kind, the activations'

    def __init__(self, model):
        cfg = model.config
        self.model, self.eps = model, cfg.rms_norm_eps
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hidden, self.inter = cfg.hidden_size, cfg.intermediate_size
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden // self.heads
        self.add_norm, self.rotate_write, self.silu_mul = (getattr(ops(), name + self.suffix)
                                                           for name in ("add_norm", "rotate_write", "silu_mul"))
        self.layers = []
        for layer in model.get_decoder().layers:
            a, m, stack = layer.self_attn, layer.mlp, self.product
            self.layers.append((layer.input_layernorm.weight, stack([a.q_proj, a.k_proj, a.v_proj]), stack([a.o_proj]),
                                layer.post_attention_layernorm.weight, stack([m.gate_proj, m.up_proj]),
                                stack([m.down_proj]), a.scaling))
        self.lock = threading.Lock()
        self.plans: dict[tuple[int, str], Plan] = {}  # by rows and attention, the forwards kept (plan)

    @classmethod
    def fits(cls, model) -> bool:
        cfg = model.config
        layers = model.get_decoder().layers
        attn, mlp = layers[0].self_attn, layers[0].mlp
        projections = [getattr(part, name) for part, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                                                (mlp, ("gate_proj", "up_proj", "down_proj"))) for name in names]
        return (model.get_input_embeddings().weight.device.type == "cpu" and cfg.model_type in ("qwen2", "llama")
                and not getattr(cfg, "use_sliding_window", False) and getattr(cfg, "hidden_act", "silu") == "silu"
                and all(isinstance(m, cls.projection) for m in projections)
                and all(norm.weight.dtype == cls.dtype for layer in layers
                        for norm in (layer.input_layernorm, layer.post_attention_layernorm))
                and model.get_decoder().norm.weight.dtype == cls.dtype
                and ops() is not None)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, cache, length: int, keep: int, tree: TreeInput | None = None,
                 prompt: bool = False, skip: tuple[int, int] | None = None) -> torch.Tensor | None:
        if not all(isinstance(layer, RoomLayer) for layer in cache.layers) or len(cache.layers) != len(self.layers):
            return None
        with self.lock:  # one forward at a time: the plans' buffers are shared (generations on threads of their own)
            return self.forward(ids, cache, length, keep, tree, prompt, skip)

    def forward(self, ids: torch.Tensor, cache, length: int, keep: int, tree: TreeInput | None, prompt: bool,
                skip: tuple[int, int] | None = None):
        n = ids.shape[1]
        h = self.model.get_input_embeddings()(ids[0]).float()  # the residual stream, [n, hidden], in float32
        attention = self.attention(prompt, length + n)
        mask, positions = self.visibility(n, length, tree, attention)
        plan = self.plans.get((n, attention)) or self.plan(n, attention)
        cos, sin = (c[0].contiguous() for c in self.model.get_decoder().rotary_emb(h[None], positions))  # [n, d]
        plan.h.value, plan.cos.value, plan.sin.value, plan.length.value = h.data_ptr(), cos.data_ptr(), sin.data_ptr(), length
        if attention == "rows":  # each row alone, as a step computes it
            counts, idx = visible(length, n, None if mask is None else mask[0, 0])
            plan.counts.value, plan.idx.value = counts.data_ptr(), None if idx is None else idx.data_ptr()
            plan.width.value = 0 if idx is None else idx.shape[1]
        plan.cache.layers, plan.cache.mask = cache.layers, mask
        for layer, (keys, values, room, stride) in zip(cache.layers, plan.cache_views):
            if not layer.is_initialized:
                empty = torch.empty(1, self.kv_heads, 0, self.head_dim, dtype=self.dtype)
                layer.update(empty, empty)
            k, v = layer.reserve(n)
            keys.value, values.value, room.value, stride.value = k.data_ptr(), v.data_ptr(), k.shape[2], k.stride(1)
        try:
            for call, args, checked in plan.calls:
                result = call(*args)
                if checked and result:
                    raise MemoryError("no memory for a product's rounded rows or the attention's scores")
        finally:
            plan.cache.layers = plan.cache.mask = None  # a kept plan must not keep a finished generation's cache alive
        return self.logits(plan.x[n - keep:], skip)

    def logits(self, x: torch.Tensor, skip: tuple[int, int] | None) -> torch.Tensor:
        """The head's logits of the last rows; `skip`: the draft's (DraftStep)."""
        return self.model.get_output_embeddings()(x)

    def plan(self, n: int, attention: str) -> Plan:
        """The calls of a forward of n rows with their arguments bound, over buffers made here (unbound, the calls'
        Python took a noticeable share of a step's time, most of all the draft's). Kept for the sizes of steps and
        passes; a prompt's (its own mask) is made for it alone."""
        d, dt = self.head_dim, self.dtype
        plan = Plan(len(self.layers))
        x = plan.x = plan.buffer("x", n, self.hidden, dt)  # each norm's output: the next product's input
        q = plan.buffer("q", self.heads, n * d, dt).view(self.heads, n, d)
        o, act = plan.buffer("o", n, self.heads * d, dt), plan.buffer("act", n, self.inter, dt)
        add = None  # the last product's output, for the residual stream
        for j, (norm1, qkv, out, norm2, gate_up, down, scale) in enumerate(self.layers):
            keys, values, room, stride = plan.cache_views[j]
            plan.add(self.add_norm, plan.h, None if add is None else add.data_ptr(), norm1.data_ptr(), n, self.hidden,
                     self.eps, x.data_ptr())
            rows = qkv.bind(plan, x, "qkv")
            plan.add(self.rotate_write, rows.data_ptr(), plan.cos, plan.sin, n, self.heads, self.kv_heads, d, q.data_ptr(),
                     keys, values, room, plan.length)
            if attention == "rows":
                plan.add(kquant_library()[0].rows_attention, q.data_ptr(), keys, values, stride, n, self.heads,
                         self.kv_heads, d, plan.counts, plan.idx, plan.width, scale, o.data_ptr(), torch.get_num_threads(),
                         checked=True)
            elif attention == "grouped":  # the draft's (step_ops.c)
                plan.add(ops().grouped_attention, q.data_ptr(), keys, values, n, self.heads, self.kv_heads, d, room,
                         plan.length, scale, o.data_ptr(), torch.get_num_threads(), checked=True)
            else:
                plan.run(functools.partial(self.attend, plan.cache, j, q, o, scale, attention == "prompt"))
            add = out.bind(plan, o, "attended")
            plan.add(self.add_norm, plan.h, add.data_ptr(), norm2.data_ptr(), n, self.hidden, self.eps, x.data_ptr())
            rows = gate_up.bind(plan, x, "gate_up")
            plan.add(self.silu_mul, rows.data_ptr(), n, self.inter, act.data_ptr())
            add = down.bind(plan, act, "down")
        norm = self.model.get_decoder().norm
        plan.add(self.add_norm, plan.h, add.data_ptr(), norm.weight.data_ptr(), n, self.hidden, self.eps, x.data_ptr())
        if attention != "prompt" and n <= PLANNED:
            self.plans[n, attention] = plan
        return plan

    def attend(self, cache, j: int, q: torch.Tensor, o: torch.Tensor, scale: float, prompt: bool) -> None:
        """Layer j's attention in PyTorch, into `o`: a prompt's rows of the exact target in one grouped call, or the
        draft's rows over a long context, each key/value head's query heads stacked as rows (its keys read as they are,
        not repeated)."""
        layer, mask, d, n = cache.layers[j], cache.mask, self.head_dim, q.shape[1]
        if prompt:
            o.copy_(row_attention(None, q[None], layer.keys, layer.values, mask, scaling=scale, prompt_pass=True)[0]
                    .reshape(n, -1))
        else:
            o.view(n, self.heads, d).copy_(F.scaled_dot_product_attention(
                q.view(1, self.kv_heads, -1, d), layer.keys, layer.values, attn_mask=mask, scale=scale)
                .view(self.heads, n, d).transpose(0, 1))

    def visibility(self, n: int, length: int, tree: TreeInput | None, attention: str):
        """(the attention's mask, [1, 1, n, length + n] booleans or None, and the rows' positions [1, n])."""
        if tree is not None:
            inputs = tree.model_inputs(length, "sdpa", "cpu")
            return inputs["attention_mask"], inputs["position_ids"]
        positions = torch.arange(length, length + n)[None]
        if n == 1 or attention in ("rows", "grouped"):  # each row sees the cache and the rows before it
            return None, positions
        causal = torch.ones(n, length + n, dtype=torch.bool).tril(length)
        # the draft's SDPA: rows ordered as the grouped query heads
        return (causal.repeat(self.heads // self.kv_heads, 1) if attention == "sdpa" else causal)[None, None], positions


class TargetForward(WrittenForward):
    """The exact target on its Q4_K/Q6_K (and Q5_K, Q8_0) blocks, float32 activations: every forward, steps, chain
    and tree passes and prompts, each row of a step or a pass computed alone (rows_attention)."""

    projection, product, dtype, suffix = KQuantLinear, KQuantProduct, torch.float32, "_f32"

    @staticmethod
    def attention(prompt: bool, positions: int) -> str:
        return "prompt" if prompt else "rows"


class DraftStep(WrittenForward):
    """The int4 draft's steps of one or a few tokens and its prompts of up to DRAFT_ROWS_MOST tokens, bfloat16
    activations; its longer prompts and trees take the general forward (None). Its attention is step_ops.c's up to
    OWN_ATTENTION_MOST positions, where PyTorch's cost more in a call's overhead than in arithmetic, and PyTorch's
    beyond (docs/benchmarks.md)."""

    projection, product, dtype = Int4Linear, Int4Product, torch.bfloat16

    def __call__(self, ids, cache, length, keep, tree=None, prompt=False, skip=None):
        if tree is not None or ids.shape[1] > DRAFT_ROWS_MOST:
            return None
        return super().__call__(ids, cache, length, keep, skip=skip)

    def logits(self, x, skip):
        """skip: the ids [lo, hi) the head leaves out (-inf, q = 0 there; Int4Linear.without), or None."""
        head = self.model.get_output_embeddings()
        return head.without(x, skip) if skip is not None and isinstance(head, Int4Linear) else head(x)

    def attention(self, prompt: bool, positions: int) -> str:
        return "grouped" if positions <= OWN_ATTENTION_MOST and self.head_dim % 16 == 0 else "sdpa"
