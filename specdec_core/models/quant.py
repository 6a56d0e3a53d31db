"""Faster Linear layers for CPUs, and the quantised weights kept in the cache.

- PackedLinear (bfloat16): the weight reordered once into oneDNN's blocked layout; the same numbers as F.linear.
- Int4Linear, the draft's (whose precision changes how many drafts are accepted, never the output): int4 weights with
  a scale and an offset per group of 32 inputs, through PyTorch's int4 product or, with AVX-512 VNNI or AVX2, our own
  (int4_vnni: activations rounded to int8 per group), which reads the fewest bytes a step waits on.
- int8.TokenInt8Linear where int4 fits no layer (float32, odd shapes), and the exact int8 target.
"""
from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .attention import ROWS
from .files import file_digest
from .kernels.int4_vnni import fits as int4_fits, pack as int4_pack, product as int4_product
from .int8 import TokenInt8Linear, saved_layout
from .kernels.kquant import KQuantLinear, q8_0
from .kernels.kquant import fits as blocks_fit
from .kernels.native import locked


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = linear.bias
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Int4Linear(nn.Module):
    """`wide`: the same weights in int8 as well, for products of WIDE rows or more (a prompt). The int4 kernels
    compute a step, which waits on memory, cheaply, but with PyTorch's a prompt cost the 0.5B draft as much as the
    1.5B int8 target's; fbgemm's int8 products take it in a fraction of that.
    Two kernels: int4_vnni's (`tiles`), where it runs, else PyTorch's (`packed`, `scales`)."""
    GROUP = 32
    WIDE = 8

    @classmethod
    def fits(cls, linear: nn.Linear) -> bool:
        """The kernels' shape rules, and bfloat16: with float32 activations PyTorch's is many times slower."""
        w = linear.weight
        return (w.device.type in ("cpu", "meta") and w.dtype == torch.bfloat16 and linear.in_features % cls.GROUP == 0
                and linear.out_features % 16 == 0)

    def __init__(self, linear: nn.Linear, saved: dict | None = None, wide: bool = False, kernel: str | None = None):
        """saved: {"tiles": int4_vnni's layout} or {"packed": PyTorch's layout (it depends on the CPU), "scales":
        [in / 32, out, 2]}, and with `wide`, the int8 twin's "wide.qweight" and "wide.scale".
        kernel: "vnni" or "torch" (None: ours where it runs), for weights quantised here; saved ones keep theirs."""
        super().__init__()
        self.bias, self.in_features, self.out_features, self.wide = linear.bias, linear.in_features, linear.out_features, None
        if wide:
            twin = {k.removeprefix("wide."): v for k, v in saved.items() if k.startswith("wide.")} if saved else None
            self.wide = TokenInt8Linear(linear, twin)
        own = (kernel or int4_kernel()) == "vnni"
        if not saved:
            w = linear.weight.detach().float()
            groups = w.reshape(w.shape[0], -1, self.GROUP)
            low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
            step = ((high - low) / 15).clamp(min=1e-12)
            # in place, one temporary: the 0.5B draft's head alone is 136M weights, a first start waits on them
            q = groups.sub(low).div_(step).round_().clamp_(0, 15).to(torch.uint8).reshape(w.shape)
            if own:
                saved = {"tiles": int4_pack(q, step[..., 0], low[..., 0])}
            else:  # PyTorch's kernel computes (q - 8) * scale + zero
                saved = {"packed": torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2),
                         "scales": torch.cat([step, low + 8 * step], -1).transpose(0, 1).contiguous()}
        n, k = self.out_features, self.in_features
        shapes = {"tiles": ((-(-n // 4), -(-k // 128), 320), torch.uint8)} if "tiles" in saved else \
            {"packed": ((n, k // 2), torch.uint8), "scales": ((k // self.GROUP, n, 2), None)}
        if any(name not in saved or saved[name].shape != shape or dtype not in (None, saved[name].dtype)
               for name, (shape, dtype) in shapes.items()):
            raise ValueError("saved int4 weights of another shape than the layer's")
        self.register_buffer("tiles", saved.get("tiles"))
        self.register_buffer("packed", saved.get("packed"))
        scales = saved.get("scales")
        self.register_buffer("scales", None if scales is None else scales.to(linear.weight.dtype))

    def saved_state(self) -> dict:
        twin = {} if self.wide is None else {f"wide.{k}": v for k, v in self.wide.saved_state().items()}
        mine = {"tiles": self.tiles} if self.tiles is not None else {"packed": self.packed, "scales": self.scales}
        return {**mine, **twin}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wide is not None and x.numel() >= self.WIDE * x.shape[-1]:
            return self.wide(x)  # adds the bias
        y = self.matmul(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def without(self, x: torch.Tensor, skip: tuple[int, int]) -> torch.Tensor:
        """The outputs but those in [lo, hi) = `skip`, which are -inf: a head whose q is 0 on those tokens, for
        the bytes of the others (int4_vnni's tiles: 4 outputs a row). Where it cannot leave them out (no tiles, a
        bias, bounds that are not multiples of 4), every output."""
        lo, hi = skip
        if self.tiles is None or self.bias is not None or lo % 4 or hi % 4 or not 0 < lo <= hi <= self.out_features:
            return self(x)
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = torch.full((len(rows), self.out_features), float("-inf"), dtype=torch.bfloat16)
        y[:, :lo] = int4_product(self.tiles[: lo // 4], rows, lo, self.in_features)
        if hi < self.out_features:
            y[:, hi:] = int4_product(self.tiles[hi // 4:], rows, self.out_features - hi, self.in_features)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles is not None:
            return int4_product(self.tiles, x.to(torch.bfloat16), self.out_features, self.in_features).to(x.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.GROUP, self.scales)


def int4_kernel() -> str:
    """The int4 draft's default kernel: int4_vnni's where it runs (int4_vnni.library() has said why not), else PyTorch's."""
    return "vnni" if int4_fits() else "torch"


def replace_linears(model: nn.Module, make, largest_first: bool = False) -> nn.Module:
    """In place: every nn.Linear `mod` named `name` becomes make(name, mod). The conversions (quantising,
    prepacking) run on a thread per core: PyTorch releases the GIL in them, and start-up waits for them.
    largest_first: for work that grows with the weights (quantising): the draft's head, last in module order, would
    keep one thread busy alone."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if largest_first:
        found.sort(key=lambda item: -item[1].weight.numel())
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        made = list(pool.map(lambda item: make(*item), found))
    for (name, _), new in zip(found, made):
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return model


def can_pack(model: nn.Module) -> bool:
    weight = model.get_input_embeddings().weight
    return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)
            and torch.backends.mkldnn.is_available())


def pack_linears(model: nn.Module) -> nn.Module:
    """In place: every plain nn.Linear left in the model becomes a PackedLinear."""
    return replace_linears(model, lambda name, mod: PackedLinear(mod))


def _int4(name: str, mod: nn.Linear, saved: dict | None) -> nn.Module:
    # the head takes the prompt's last position only: no twin for it
    return Int4Linear(mod, saved, wide=name != "lm_head") if Int4Linear.fits(mod) else TokenInt8Linear(mod, saved)


def quant_label(model: nn.Module) -> str:
    """What a quantised draft got: "int4", or "int8" where the int4 product fits none of its layers."""
    return "int4" if any(isinstance(m, Int4Linear) for m in model.modules()) else "int8"


def draft_to_int4(model: nn.Module, saved: Path | None = None, source: str = "") -> nn.Module:
    """In place: every Linear int4 (Int4Linear), or int8 (TokenInt8Linear) where the int4 product does not fit it
    (float32, odd shapes).

    saved, source: see quantise (quantising the 0.5B draft would be most of a warm start)."""
    dtype = model.get_input_embeddings().weight.dtype
    layout = " (int4_vnni's tiles)" if int4_kernel() == "vnni" else ""
    quantise(model, _int4, saved, f"{source}\nint4{layout}, int8 from {Int4Linear.WIDE} rows, {dtype}")
    return model


def quantise_target(model: nn.Module, saved: Path | None = None, source: str = "") -> nn.Module:
    """In place: every Linear becomes a TokenInt8Linear, each row's attention is computed as a one-token step
    computes it (attention.ROWS), everything else in float32: a position's logits are the same, bit for bit,
    alone or in any verification pass, chain or tree.

    Rounding an activation to int8 magnifies any difference in it, however small: a product that sums in
    another order in a 17-row pass than in a one-row step (as batched attention does) flips int8 roundings
    and moves logits by more than 1. Integer products are exact in any order, and the attention computes
    a row with the same products whatever pass it is in. saved/source as in draft_to_int4."""
    quantise(model, lambda name, mod, kept: TokenInt8Linear(mod, kept), saved, f"{source}\ntoken-int8")
    model.set_attn_implementation(ROWS)
    return model.float()


def target_on_blocks(model: nn.Module) -> nn.Module:
    """In place: every Linear computes on Q8_0 blocks made from its values (kquant.q8_0), each row's attention as a
    one-token step computes it (attention.ROWS), the rest in float32: the arithmetic of a GGUF target, exact the same
    way (quantise_target says why each part is needed)."""
    def blocks(name, mod):
        return KQuantLinear(q8_0(mod.weight), 8, mod.in_features, mod.out_features, mod.bias)
    replace_linears(model, blocks, largest_first=True)
    model.set_attn_implementation(ROWS)
    return model.float()


def fits_blocks(model: nn.Module) -> bool:
    """Whether every Linear of the model has a shape the blocks product computes."""
    return all(blocks_fit(m.out_features, m.in_features) for m in model.modules() if isinstance(m, nn.Linear))


def quantise(model: nn.Module, make, saved: Path | None, source: str) -> None:
    """Every nn.Linear `mod` named `name` becomes make(name, mod, its saved tensors or None).

    saved: a file for the quantised weights, written on first use and read afterwards; `source` names
    the weights and the mode they came from, and a file made from others, or for another CPU or torch
    (packed layouts depend on both), is made again."""
    source = f"{source}, torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, int8 {saved_layout()}"
    if saved is None:
        made_anew(model, make)
        return
    if made_from(model, make, load_saved(saved, source)):
        return  # a file whose digest and shapes hold needs no lock: another start may hold it
    try:
        with locked(saved.parent, saved.name + ".lock"):  # two starts on one cache: the second reads the first's file
            if not made_from(model, make, load_saved(saved, source)):
                made_anew(model, make)
                write_saved(model, saved, source)
    except OSError as err:  # a lock or file that cannot be opened: the layers made here, kept for this run only
        warnings.warn(f"the quantised weights could not be kept in the cache ({err.strerror or err})", RuntimeWarning)
        if any(isinstance(m, nn.Linear) for m in model.modules()):  # not made yet (else the write failed)
            made_anew(model, make)


def made_from(model: nn.Module, make, tensors: dict) -> bool:
    """Every nn.Linear made from saved `tensors` ({"layer name:field": tensor}). False, and nothing changed, where
    there are none or they do not fit the layers (shapes of another model: never handed to a kernel)."""
    layers: dict[str, dict] = {}
    for key, value in tensors.items():
        name, _, field = key.rpartition(":")
        layers.setdefault(name, {})[field] = value
    if not tensors or set(layers) != {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}:
        return False
    try:
        replace_linears(model, lambda name, mod: make(name, mod, layers[name]))
    except ValueError:
        return False
    return True


def made_anew(model: nn.Module, make) -> None:
    """Every nn.Linear made from its values, quantised now."""
    replace_linears(model, lambda name, mod: make(name, read(mod), None), largest_first=True)


def write_saved(model: nn.Module, saved: Path, source: str) -> None:
    layers = {name: mod for name, mod in model.named_modules() if hasattr(mod, "saved_state")}
    # a layer saves the layers inside it (Int4Linear's int8 twin) with its own
    outer = [name for name in layers if name.rpartition(".")[0] not in layers]
    state = {f"{name}:{key}": value.contiguous() for name in outer for key, value in layers[name].saved_state().items()}
    partial, digest = saved.with_name(saved.name + ".partial"), saved.with_name(saved.name + ".sha256")
    save_file(state, str(partial), metadata={"source": source})
    digest.with_name(digest.name + ".partial").write_text(file_digest(partial))
    partial.replace(saved)  # a start cut short never leaves half a file behind
    digest.with_name(digest.name + ".partial").replace(digest)


def read(linear: nn.Linear) -> nn.Linear:
    """A Linear whose weight was left in its file (on the meta device, gguf_model.load_dense(lazy=True)) read now:
    quantised weights made before need no values."""
    if linear.weight.is_meta:
        linear.weight = nn.Parameter(linear.values(), requires_grad=False)
    return linear


def load_saved(path: Path, source: str) -> dict:
    """The tensors of a saved quantised model, or {} when there is none, it is unreadable, made from other weights, or
    its bytes are not those it was written with (its SHA-256, kept beside it)."""
    try:
        if path.with_name(path.name + ".sha256").read_text() != file_digest(path):
            return {}
        with safe_open(str(path), "pt") as f:
            if (f.metadata() or {}).get("source") != source:
                return {}
            # copies: a tensor read in place may sit unaligned in the file, and the int8 kernels crash on that
            return {key: f.get_tensor(key).clone() for key in f.keys()}
    except Exception:
        return {}
