"""Qwen2 and Llama models read from GGUF files as they are: no converted copy on disk.

The target keeps the file's blocks (kquant.KQuantLinear, exact: the same logits in a step and in any pass): Q4_K, Q5_K,
Q6_K and Q8_0 as they are, Q4_0 and Q5_0 as the same values in Q8_0, other types rounded to Q8_0. The draft's weights
are dequantised in memory, in the dtype it runs in, and then quantised as every draft is (quant.draft_to_int4).
Tensors are read through a memory map of the file (gguf_file.py).
"""
from __future__ import annotations

import itertools
from pathlib import Path

import torch
from torch import nn
from transformers import GenerationConfig, LlamaForCausalLM, Qwen2ForCausalLM
from transformers.initialization import no_init_weights

from .gguf_file import ARCHITECTURES, GGUF, dequantise, q8_0_of
from .kernels.kquant import GGML_TYPES, KQuantLinear, as_bytes, packed_size

HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


class RowsEmbedding(nn.Module):
    """An embedding kept as its file's bytes, a looked-up row turned into values when it is read: the same values as
    the whole table's, which in float32 would be 933 MB for the bundled target (bfloat16: 272 MB for its draft),
    where a step reads one row."""

    def __init__(self, raw: torch.Tensor, kind: int, num: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.raw = as_bytes(raw).clone().reshape(num, -1)  # not a view of a mapped file
        self.kind, self.num, self.dim, self.dtype = kind, num, dim, dtype

    @property
    def weight(self) -> torch.Tensor:
        """Only its shape, dtype and device are real (what callers read of an embedding's weight)."""
        return torch.zeros(1, dtype=self.dtype).expand(self.num, self.dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if len(flat) and (int(flat.min()) < 0 or int(flat.max()) >= self.num):
            raise IndexError(f"token ids outside the embedding's {self.num} rows")
        rows = dequantise(self.raw[flat].reshape(-1), self.kind, len(flat), self.dim)
        return rows.to(self.dtype).reshape(*ids.shape, self.dim)


def skeleton(f: GGUF) -> Qwen2ForCausalLM | LlamaForCausalLM:
    """The model with its weights on the meta device (nothing allocated), its rotary buffers real: with a Llama 3.1
    file's own factors of its rotary frequencies (`rope_freqs.weight`: each frequency divided by its factor)."""
    config = f.config()
    with no_init_weights(), torch.device("meta"):
        model = ARCHITECTURES[f.architecture][1](config)
    rotary = model.model.rotary_emb = type(model.model.rotary_emb)(config)
    if "rope_freqs.weight" in f.tensors:
        factors = f.dense("rope_freqs.weight")
        if factors.shape != rotary.inv_freq.shape:
            raise ValueError(f"{f.name}'s rope_freqs has {len(factors)} factors for {len(rotary.inv_freq)} frequencies")
        rotary.inv_freq = rotary.original_inv_freq = rotary.inv_freq / factors
    return model


def hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens"
    if gguf_name == "output.weight":
        return "lm_head"
    if gguf_name == "output_norm.weight":
        return "model.norm"
    _, layer, part, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{HF_NAMES[part]}"


def fill(model: nn.Module, f: GGUF, make_linear, make_embedding) -> nn.Module:
    """Every tensor of `f` put in its place: norms and biases as float32 parameters, weights of Linear layers and
    the embedding as make_linear(gguf name, bias) and make_embedding(gguf name) make them."""
    names = sorted(n for n in f.tensors if n.endswith(".weight") and n != "rope_freqs.weight")
    for name in names:
        target = hf_name(name)
        parent, _, child = target.rpartition(".")
        old = model.get_submodule(target)
        if isinstance(old, nn.Linear):
            bias_name = name.replace(".weight", ".bias")
            bias = f.dense(bias_name) if bias_name in f.tensors else None
            setattr(model.get_submodule(parent), child, make_linear(name, bias))
        elif isinstance(old, nn.Embedding):
            setattr(model.get_submodule(parent), child, make_embedding(name))
        else:  # a norm
            old.weight = nn.Parameter(f.dense(name), requires_grad=False)
    if model.config.tie_word_embeddings:
        model.lm_head = make_linear("token_embd.weight", None)
    lazy = {f"{n}.weight" for n, m in model.named_modules() if hasattr(m, "values")}  # load_dense(lazy=True)
    left = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta and n not in lazy]
    if left:
        raise ValueError(f"{f.name} lacks the weights of {', '.join(left[:3])}")
    model.generation_config = GenerationConfig(bos_token_id=model.config.bos_token_id,
                                               eos_token_id=model.config.eos_token_id,
                                               pad_token_id=model.config.pad_token_id)
    return model.eval()


def block_kind(f: GGUF, name: str) -> tuple[int, int, int]:
    """(the kind of blocks a weight is computed on, outputs, inputs): its file's own, or for another type Q8_0's
    (q8_0_of)."""
    kind, dims, _, _ = f.tensors[name]
    return GGML_TYPES.get(kind, 8), int(dims[-1]), int(dims[0])


def blocks_of(f: GGUF, name: str) -> tuple[torch.Tensor, int, int, int]:
    """A weight as blocks of a kind kquant computes on: the file's own, or Q8_0 ones (q8_0_of)."""
    raw, kind, n, k = f.raw(name)
    if kind in GGML_TYPES:
        return raw, GGML_TYPES[kind], n, k
    return q8_0_of(raw, kind, n, k), 8, n, k


TOGETHER = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))  # what a step computes in one product (step.py)


def side_by_side(f: GGUF) -> dict[str, torch.Tensor]:
    """{GGUF name: where its packed weights go}: each run of one kind among the projections a step computes together
    in one buffer, one after another, so that the step joins them where they lie, not in a copy."""
    into = {}
    for layer in range(f.field(f"{f.architecture}.block_count")):
        for group in TOGETHER:
            shapes = {name: block_kind(f, name) for name in (f"blk.{layer}.{part}.weight" for part in group)}
            for _, run in itertools.groupby(shapes, key=lambda name: shapes[name][0]):
                run = list(run)
                sizes = [packed_size(*shapes[name]) for name in run]
                into.update(zip(run, torch.empty(sum(sizes), dtype=torch.uint8).split(sizes)))
    return into


def load_target(path: Path | list[Path] | GGUF) -> Qwen2ForCausalLM:
    """The exact target on the file's blocks, float32 elsewhere."""
    f = path if isinstance(path, GGUF) else GGUF(path)
    model = skeleton(f)
    into = side_by_side(f)

    def linear(name, bias):
        raw, kind, n, k = blocks_of(f, name)
        return KQuantLinear(raw, kind, k, n, bias, into=into.get(name))

    return fill(model, f, linear, lambda name: RowsEmbedding(*f.raw(name), torch.float32)).float()


def load_dense(path: Path | list[Path] | GGUF, dtype: torch.dtype, lazy: bool = False) -> Qwen2ForCausalLM:
    """The model's values in `dtype`: the draft before it is quantised, or a target run as loaded. lazy: the Linear
    layers' weights are left in the file (on the meta device, each Linear's values() reads them), for a model whose
    quantised weights may have been made before (quant.quantise reads what it needs)."""
    f = path if isinstance(path, GGUF) else GGUF(path)
    model = skeleton(f)

    def linear(name, bias):
        _, _, n, k = f.raw(name)
        layer = nn.Linear(k, n, bias=bias is not None, device="meta", dtype=dtype)
        layer.values = lambda: f.dense(name).to(dtype)
        if not lazy:
            layer.weight = nn.Parameter(layer.values(), requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
        return layer

    def embedding(name):  # on CPUs (lazy) its rows are read as looked up; elsewhere a table, to move to the device
        if lazy:
            return RowsEmbedding(*f.raw(name), dtype)
        return nn.Embedding.from_pretrained(f.dense(name).to(dtype), freeze=True)
    model = fill(model, f, linear, embedding)
    for norm in model.modules():  # the norms as the model's dtype, as a checkpoint in that dtype loads them
        if not isinstance(norm, (nn.Linear, nn.Embedding, RowsEmbedding)) and getattr(norm, "weight", None) is not None:
            norm.weight = nn.Parameter(norm.weight.to(dtype), requires_grad=False)
    return model
