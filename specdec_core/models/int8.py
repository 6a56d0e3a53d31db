"""The exact int8 target's layers (TokenInt8Linear, made by quant.quantise_target): the target's values made int8 per
output channel, times activations rounded to int8 per row, so that a position's logits are the same bits alone and in
any pass. Where the target has no Q4_K/Q6_K blocks to compute on (custom pairs, CPUs without AVX-512 VNNI), this is
what makes it exact; the int4 draft's int8 twin is one too."""
from __future__ import annotations

import functools
import os
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .int8_vnni import Int8Product, fits as vnni_fits


def channel_scales(w: torch.Tensor) -> torch.Tensor:
    """One int8 scale per output channel (row) of a float32 weight."""
    return (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)


def int8_weights(linear: nn.Linear, saved: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weights [out, in] and their float64 scale per output channel: `saved` ones, else the linear's, quantised."""
    if saved:
        return saved["qweight"], saved["scale"]
    w = linear.weight.detach().float()
    scale = channel_scales(w)
    # torch.quantize_per_channel's arithmetic (times the float inverse, half to even), in a fifth of its time
    return (w * (1 / scale)[:, None]).round_().clamp_(-128, 127).to(torch.int8), scale.double()


def fbgemm_pack(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wq = torch._make_per_channel_quantized_tensor(qweight, scale, torch.zeros_like(scale, dtype=torch.long), 0)
    return torch.ops.quantized.linear_prepack(wq, bias)


def fbgemm_state(packed: torch.Tensor) -> dict:
    wq, _ = torch.ops.quantized.linear_unpack(packed)
    return {"qweight": wq.int_repr(), "scale": wq.q_per_channel_scales()}


class TokenInt8Linear(nn.Module):
    """int8 weights (a scale per output channel) times int8 activations with a scale per token (row).

    For a target: a position's output must not depend on the other tokens verified with it, or greedy
    output would match plain decoding only by luck. Each row is rounded to int8 against its own largest
    magnitude, integer products are exact in any order, and each row is scaled back afterwards. Two kernels:
    - "fbgemm" (any x86 CPU): its dynamic linear picks one range for its whole input, so each row is first
      divided by its own largest magnitude and a row holding -1 and +1 is appended: the range is [-1, 1]
      whatever the other rows are.
    - "vnni" (the default on other x86 CPUs with AVX-512 VNNI, where a C compiler builds it): int8_vnni's product,
      which rounds each row alone and reads a weight once for six rows, so a pass costs little more than a step.
    - "onednn" (the default where the CPU has AMX tiles): oneDNN's int8 product of rows rounded here. A
      pass's rows share the tiles, so a 16-row pass costs little more than a step, where fbgemm's cost grows
      with every row. A step's one row is padded to two (oneDNN has a slow reference kernel for one row of
      a narrow product), and a probe per shape (`onednn_rows_agree`) checks that a row gets the same bits
      alone and among others; where it does not, the layer takes fbgemm.
    """

    def __init__(self, linear: nn.Linear, saved: dict | None = None, kernel: str | None = None):
        """saved: {"qweight": int8 [out, in], "scale": float64 [out]} from `saved_state`, else quantise now."""
        super().__init__()
        self.bias = None if linear.bias is None else linear.bias.detach().float()  # added once a row is scaled back
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.plain = None
        qweight, scale = int8_weights(linear, saved)
        self.kernel = int8_kernel(kernel, linear.in_features)
        if self.kernel == "vnni":
            self.packed = Int8Product(qweight, scale, self.bias)
            self.plain = None if saved else {"qweight": qweight, "scale": scale}  # for the file, then dropped
            return
        if self.kernel == "onednn":
            self.packed = torch.ops.onednn.qlinear_prepack(qweight, None)
            self.scales = (scale / 127).float()  # a row rounded against its largest magnitude spans [-127, 127]
            self.zeros = torch.zeros(len(scale), dtype=torch.long)
            self.plain = None if saved else {"qweight": qweight, "scale": scale}  # for the file, then dropped
            if onednn_rows_agree(self):
                return
            self.kernel, self.scales, self.zeros, self.plain = "fbgemm", None, None, None
        self.packed = fbgemm_pack(qweight, scale)
        self.pin = torch.zeros(1, linear.in_features)
        self.pin[0, :2] = torch.tensor([-1.0, 1.0])

    def saved_state(self) -> dict:
        return fbgemm_state(self.packed) if self.kernel == "fbgemm" else self.plain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        if self.kernel == "vnni":  # rounds, scales back and adds the bias itself
            return self.packed(rows).reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        size = rows.abs().amax(-1, keepdim=True).clamp(min=1e-30)
        if self.kernel == "onednn":
            q = torch.round(rows * (127 / size)).to(torch.int8)
            q = F.pad(q, (0, 0, 0, 1)) if len(q) == 1 else q
            y = torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, self.packed, self.scales, self.zeros, None, 1.0, 0,
                                                   torch.float32, "none", [], "")[: len(rows)] * size
        else:
            y = torch.ops.quantized.linear_dynamic(torch.cat([rows / size, self.pin]), self.packed, True)[:-1] * size
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


INT8_KERNELS = ("vnni", "onednn", "fbgemm")  # TokenInt8Linear's


def int8_kernel(asked: str | None, in_features: int) -> str:
    """The kernel asked for, by default oneDNN where the CPU has AMX int8 tiles, else our own; ours gives way to
    fbgemm where it cannot run (int8_vnni.library() has said why) or the shape does not fit."""
    asked = asked or ("onednn" if amx_int8() else "vnni")
    return "fbgemm" if asked == "vnni" and not vnni_fits(in_features) else asked


@functools.cache
def amx_int8() -> bool:
    """Whether this CPU has AMX int8 tiles, the system lets this process use them and oneDNN is not capped below
    them (ONEDNN_MAX_CPU_ISA): its int8 products need them, and without they are many times slower than fbgemm's."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL")).upper()
    return (cap == "ALL" or "AMX" in cap) and bool(torch._C._cpu._get_cpu_capability().get("amx_int8")) \
        and torch._C._cpu._init_amx()


_int8_agrees: dict = {}  # onednn_rows_agree's answers, by the product's shape


def onednn_rows_agree(layer: TokenInt8Linear) -> bool:
    """Whether the layer's oneDNN product gives a row the same bits alone (a step) and among 2 to 65 rows (the
    passes of chains and trees), on random rows, once per shape."""
    key = (layer.in_features, layer.out_features)
    if key not in _int8_agrees:
        x = torch.randn(65, layer.in_features, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            alone = {i: layer(x[i: i + 1])[0] for i in (*range(17), 64)}
            batches = [layer(x[:m]) for m in (2, 5, 16, 17, 65)]
            _int8_agrees[key] = all(torch.equal(batch[i], row) for batch in batches for i, row in alone.items() if i < len(batch))
    return _int8_agrees[key]
