"""Qwen2 and Llama models read from GGUF files as they are: no converted copy on disk.

The target keeps the file's blocks (kquant.KQuantLinear, exact: the same logits in a step and in any pass): Q4_K, Q5_K,
Q6_K and Q8_0 as they are, Q4_0 and Q5_0 as the same values in Q8_0, other types rounded to Q8_0. The draft's weights
are dequantised in memory, in the dtype it runs in, and then quantised as every draft is (quant.cheapen_draft). Tensors are read through a memory map of the file.
"""
from __future__ import annotations

import itertools
import struct
import warnings
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants
from torch import nn
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.initialization import no_init_weights

from .kquant import GGML_TYPES, ROW_KINDS, KQuantLinear, as_bytes, dequantise_rows, packed_size

HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
ARCHITECTURES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


class GGUF:
    """A GGUF file's metadata and tensors (by GGUF name), read from memory maps of the file, or of the parts its bytes
    are cut into, in order, read where they lie. (gguf's GGUFReader turns every one of the 150,000 tokens into numpy
    objects: 9 s for the bundled target, against 0.1 s here.) `shards`: the other files of a model split by
    llama.cpp's gguf-split (each a GGUF file of its own, holding some of the tensors), their tensors read as this
    file's."""

    def __init__(self, paths: Path | list[Path], shards: list[Path] = ()):
        self.paths = [Path(p) for p in (paths if isinstance(paths, (list, tuple)) else [paths])]
        self.maps = [np.memmap(p, dtype=np.uint8, mode="r") for p in self.paths]
        self.starts = np.cumsum([0] + [len(m) for m in self.maps])
        head = 1 << 24
        while True:  # the metadata, from a copy of the file's first bytes, grown until it holds them all
            self.data, self.pos = self.read(0, min(head, int(self.starts[-1]))), 4
            try:
                self.parse()
                break
            except struct.error:
                if head >= self.starts[-1]:
                    raise ValueError(f"{self.name} is cut short") from None
                head *= 4
        del self.data
        self.holders = {}  # tensor name -> the shard that holds it, where another does
        for i, shard in enumerate(map(GGUF, shards), 1):
            if int(shard.field("split.no", -1)) != i:
                raise ValueError(f"{shard.name} is not part {i + 1} of {self.name}")
            for name in shard.tensors:
                if name in self.tensors:
                    raise ValueError(f"{shard.name} holds {name} again")
                self.holders[name] = shard
            self.tensors.update(shard.tensors)
        count = int(self.field("split.count", 1))
        if not shards and int(self.field("split.no", 0)) == 0 and count != 1:
            raise ValueError(f"{self.name} is one of {count} files, read with 1")

    @property
    def name(self) -> str:
        return self.paths[0].name

    def read(self, start: int, end: int) -> np.ndarray:
        """The bytes [start, end) of the whole: a view of one part's map, or a copy joining two or more."""
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        if end <= self.starts[i + 1]:
            return self.maps[i][start - self.starts[i]: end - self.starts[i]]
        pieces = []
        while start < end:
            stop = min(end, int(self.starts[i + 1]))
            pieces.append(self.maps[i][start - self.starts[i]: stop - self.starts[i]])
            start, i = stop, i + 1
        return np.concatenate(pieces)

    def parse(self) -> None:
        if bytes(self.data[:4]) != b"GGUF" or self.scalar("<I", 4) not in (2, 3):
            raise ValueError(f"{self.name} is not a GGUF file of version 2 or 3")
        tensors, kvs = self.scalar("<Q", 8), self.scalar("<Q", 8)
        self.fields, self.arrays = {}, {}  # key -> value (arrays: None), array key -> its bytes
        for _ in range(kvs):
            key = self.string()
            start = self.pos
            self.fields[key] = self.value(self.scalar("<I", 4))
            if self.fields[key] is None:
                self.arrays[key] = bytes(self.data[start: self.pos])
        # the metadata alone, as a GGUF file without tensors (what reading a tokenizer needs)
        self.metadata = b"GGUF" + bytes(self.data[4:8]) + struct.pack("<QQ", 0, kvs) + bytes(self.data[24: self.pos])
        infos = []
        for _ in range(tensors):
            name = self.string()
            dims = [self.scalar("<Q", 8) for _ in range(self.scalar("<I", 4))]
            infos.append((name, dims, self.scalar("<I", 4), self.scalar("<Q", 8)))
        align = int(self.fields.get("general.alignment", 32))
        base = -(-self.pos // align) * align
        self.tensors = {}  # name -> (GGML type, shape as [inputs, outputs], offset, bytes)
        for name, dims, kind, offset in infos:
            block, size = GGML_QUANT_SIZES[T(kind)]
            count = int(np.prod(dims))
            self.tensors[name] = (kind, dims, base + offset, count // block * size)
            if base + offset + count // block * size > self.starts[-1]:
                raise ValueError(f"{self.name} is cut short: its tensor {name} runs past its end")

    def scalar(self, fmt: str, size: int):
        (v,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return v

    def string(self) -> str:
        n = self.scalar("<Q", 8)
        self.pos += n
        return bytes(self.data[self.pos - n: self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:  # skipped: read only as bytes (vocabulary)
            item, n = self.scalar("<I", 4), self.scalar("<Q", 8)
            if item == STRING:
                for _ in range(n):
                    self.pos += 8 + struct.unpack_from("<Q", self.data, self.pos)[0]
            else:
                self.pos += n * struct.calcsize(SCALARS[item])
            return None
        fmt = SCALARS[kind]
        return self.scalar(fmt, struct.calcsize(fmt))

    def field(self, key: str, default=None):
        return self.fields.get(key, default)

    @property
    def architecture(self) -> str:
        arch = self.field("general.architecture")
        if arch not in ARCHITECTURES:
            raise ValueError(f"{self.name} holds a {arch} model; GGUF files are read for "
                             f"{' and '.join(ARCHITECTURES)} models")
        return arch

    def config(self) -> Qwen2Config | LlamaConfig:
        arch = self.architecture
        a = lambda key: self.field(f"{arch}.{key}")
        extra = {} if a("attention.key_length") in (None, a("embedding_length") // a("attention.head_count")) \
            else {"head_dim": a("attention.key_length")}
        return ARCHITECTURES[arch][0](vocab_size=int(self.tensors["token_embd.weight"][1][1]),
                           hidden_size=a("embedding_length"),
                           intermediate_size=a("feed_forward_length"), num_hidden_layers=a("block_count"),
                           num_attention_heads=a("attention.head_count"), num_key_value_heads=a("attention.head_count_kv"),
                           max_position_embeddings=a("context_length"), rms_norm_eps=a("attention.layer_norm_rms_epsilon"),
                           rope_parameters={"rope_theta": a("rope.freq_base"), "rope_type": "default"},
                           tie_word_embeddings="output.weight" not in self.tensors,
                           bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
                           eos_token_id=self.field("tokenizer.ggml.eos_token_id"),
                           pad_token_id=self.field("tokenizer.ggml.padding_token_id"), **extra)

    def vocabulary(self) -> tuple:
        """What two models must share to share a tokenizer: the tokens, the merges, the special ids."""
        arrays = [self.arrays.get(k) for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")]
        return (*arrays, *(self.field(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")))

    def raw(self, name: str) -> tuple[torch.Tensor, int, int, int]:
        """(the tensor's bytes, its GGML type, outputs, inputs): a view of the file, not a copy."""
        kind, dims, offset, size = self.tensors[name]
        with warnings.catch_warnings():  # read-only memory: nothing here writes to it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(self.holders.get(name, self).read(offset, offset + size))
        n, k = int(dims[-1]) if len(dims) > 1 else 1, int(dims[0])
        heads = self.rotated_heads(name)
        if heads:  # whole rows moved (a row is whole blocks): a copy in PyTorch's order
            order = torch.arange(n).reshape(heads, -1, 2).transpose(1, 2).reshape(-1)
            raw = raw.reshape(n, -1)[order].reshape(-1)
        return raw, kind, n, k

    def rotated_heads(self, name: str) -> int:
        """For a Llama file's query and key weights, their heads: llama.cpp's converter interleaves each head's two
        rotated halves (row i of a half goes to row 2i or 2i + 1), which PyTorch's Llama keeps apart; else 0."""
        if self.architecture != "llama" or not name.endswith((".attn_q.weight", ".attn_k.weight")):
            return 0
        return int(self.field("llama.attention.head_count" + ("_kv" if ".attn_k." in name else "")))

    def dense(self, name: str) -> torch.Tensor:
        """The tensor's values in float32, shaped as PyTorch's [out, in] (or [n])."""
        raw, kind, n, k = self.raw(name)
        values = dequantise(raw, kind, n, k)
        return values if len(self.tensors[name][1]) > 1 else values[0]


def dequantise(raw: torch.Tensor, kind: int, n: int, k: int) -> torch.Tensor:
    """The values of a GGUF tensor of type `kind` as float32 [n, k]: the types a Q4_K_M file holds here, any other
    through gguf's own reading of it."""
    if kind == T.F32:
        return raw.view(torch.float32).reshape(n, k).clone()
    if kind == T.F16:
        return raw.view(torch.float16).reshape(n, k).float()
    if GGML_TYPES.get(kind) in ROW_KINDS:
        return dequantise_rows(raw, GGML_TYPES[kind], k, torch.arange(n))
    if kind in SMALL:
        blocks = raw.reshape(n * k // 32, -1)
        d = blocks[:, :2].contiguous().view(torch.float16).float()
        return (d * small_ints(blocks, kind).float()).reshape(n, k)
    values = gguf_quants.dequantize(raw.numpy().reshape(n, -1), T(kind))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(n, k)


SMALL = (T.Q4_0, T.Q5_0, T.Q8_0)  # blocks of 32 values d * q, q a small integer


def small_ints(blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """The q of Q8_0 (d, 32 int8), Q5_0 (d, 32 high bits, 16 bytes of nibbles: values 0-15 low, 16-31 high) or Q4_0
    (d, 16 bytes of nibbles) blocks [count, bytes] as int8 [count, 32]: for Q5_0 and Q4_0, q - 16 and q - 8."""
    if kind == T.Q8_0:
        return blocks[:, 2:].contiguous().view(torch.int8)
    qs = blocks[:, -16:]
    q = torch.cat([qs & 15, qs >> 4], 1)
    if kind == T.Q5_0:
        q = q | torch.from_numpy(np.unpackbits(blocks[:, 2:6].numpy(), axis=1, bitorder="little")) << 4
    return q.view(torch.int8) - (16 if kind == T.Q5_0 else 8)


def q8_0_of(raw: torch.Tensor, kind: int, n: int, k: int) -> torch.Tensor:
    """A weight as Q8_0 blocks: Q4_0's and Q5_0's exactly (the same d, their q as int8), any other type's values
    rounded to Q8_0 by gguf's quantiser (F16, BF16 and F32 weights, and types without a product here)."""
    if kind in SMALL:
        blocks = raw.reshape(n * k // 32, -1)
        return torch.cat([blocks[:, :2], small_ints(blocks, kind).view(torch.uint8)], 1).reshape(-1)
    values = dequantise(raw, kind, n, k).numpy()
    return torch.from_numpy(gguf_quants.quantize(values, T.Q8_0)).reshape(-1)


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
