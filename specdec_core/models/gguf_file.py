"""GGUF files read as they are: their metadata and tensors from memory maps (GGUF), and a tensor's values or blocks
(dequantise, q8_0_of). The models built from them are in gguf_model.py."""
from __future__ import annotations

import struct
import warnings
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from .kernels.kquant import GGML_TYPES, ROW_KINDS, dequantise_rows, q8_0

ARCHITECTURES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


class GGUF:
    """A GGUF file's metadata and tensors (by GGUF name), read from memory maps of the file, or of the parts its bytes
    are cut into, in order, read where they lie. (gguf's GGUFReader turns every one of the 150,000 tokens into numpy
    objects, which takes seconds where this takes a fraction of one.) `shards`: the other files of a model split by
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
        config = ARCHITECTURES[arch][0]
        return config(vocab_size=int(self.tensors["token_embd.weight"][1][1]), hidden_size=a("embedding_length"),
                      intermediate_size=a("feed_forward_length"), num_hidden_layers=a("block_count"),
                      num_attention_heads=a("attention.head_count"), num_key_value_heads=a("attention.head_count_kv"),
                      max_position_embeddings=a("context_length"), rms_norm_eps=a("attention.layer_norm_rms_epsilon"),
                      # a file without a base of its own takes RoPE's original 10,000, as llama.cpp reads it
                      rope_parameters={"rope_theta": a("rope.freq_base") or 10000.0, "rope_type": "default"},
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
    rounded to Q8_0 as a Hub target's are (kquant.q8_0: F16, BF16 and F32 weights, and types without a product
    here)."""
    if kind in SMALL:
        blocks = raw.reshape(n * k // 32, -1)
        return torch.cat([blocks[:, :2], small_ints(blocks, kind).view(torch.uint8)], 1).reshape(-1)
    return q8_0(dequantise(raw, kind, n, k)).reshape(-1)
