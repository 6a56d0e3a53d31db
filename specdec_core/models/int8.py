"""The exact int8 target's layers (TokenInt8Linear, made by quant.quantise_target): the target's values made int8 per
output channel, times activations rounded to int8 per row, so that a position's logits are the same bits alone and in
any pass. Where the target has no GGUF blocks to compute on (Hub pairs of other shapes, CPUs without AVX2 or a compiler), this is
what makes it exact; the int4 draft's int8 twin is one too."""
from __future__ import annotations

import warnings

import torch
from torch import nn

from .kernels.int8_vnni import Int8Product, fits as vnni_fits


def channel_scales(w: torch.Tensor) -> torch.Tensor:
    """One int8 scale per output channel (row) of a float32 weight."""
    return (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)


def int8_weights(linear: nn.Linear, saved: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weights [out, in] and their float64 scale per output channel: `saved` ones (fbgemm's, or int8_vnni's
    layout unpacked), else the linear's, quantised."""
    if saved and "colsum" in saved:  # [out / 16, in / 4, 16 outputs, 4 inputs], outputs padded to 32
        tiles = saved["weight"]
        weight, scale = tiles.permute(0, 2, 1, 3).reshape(len(saved["colsum"]), -1)[: len(saved["scale"])], saved["scale"]
    elif saved:
        weight, scale = saved["qweight"], saved["scale"]
    if saved:
        if weight.shape != (linear.out_features, linear.in_features) or scale.shape != (linear.out_features,):
            raise ValueError("saved int8 weights of another shape than the layer's")
        return weight, scale
    w = linear.weight.detach().float()
    scale = channel_scales(w)
    # torch.quantize_per_channel's arithmetic (times the float inverse, half to even), in a fifth of its time
    return (w * (1 / scale)[:, None]).round_().clamp_(-128, 127).to(torch.int8), scale.double()


def saved_layout() -> str:
    """The layout an int8 layer saves its weights in here (a cache file's source names it, so that a file in the
    other is made again in the one read fastest): int8_vnni's tiles, or rows as fbgemm takes them."""
    return "tiles" if vnni_fits(4) else "rows"


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
    - "vnni" (x86 CPUs with AVX-512 VNNI, where a C compiler builds it): int8_vnni's product, which rounds each row
      alone and reads a weight once for six rows, so a pass costs little more than a step.
    - "fbgemm" (any x86 CPU, the fallback): its dynamic linear picks one range for its whole input, so each row is
      first divided by its own largest magnitude and a row holding -1 and +1 is appended: the range is [-1, 1]
      whatever the other rows are.
    """

    def __init__(self, linear: nn.Linear, saved: dict | None = None):
        """saved: `saved_state()` of a layer of either kernel, else quantise now."""
        super().__init__()
        self.bias = None if linear.bias is None else linear.bias.detach().float()  # added once a row is scaled back
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = "vnni" if vnni_fits(linear.in_features) else "fbgemm"
        if self.kernel == "vnni":
            read = saved and "colsum" in saved  # in the kernel's layout already
            self.packed = Int8Product.read(saved, self.bias) if read else Int8Product(*int8_weights(linear, saved), self.bias)
            if (self.packed.out_features, self.packed.in_features) != (self.out_features, self.in_features):
                raise ValueError("saved int8 weights of another shape than the layer's")
            return
        self.packed = fbgemm_pack(*int8_weights(linear, saved))
        self.pin = torch.zeros(1, linear.in_features)
        self.pin[0, :2] = torch.tensor([-1.0, 1.0])

    def saved_state(self) -> dict:
        return fbgemm_state(self.packed) if self.kernel == "fbgemm" else self.packed.state()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        if self.kernel == "vnni":  # rounds, scales back and adds the bias itself
            return self.packed(rows).reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        size = rows.abs().amax(-1, keepdim=True).clamp(min=1e-30)
        y = torch.ops.quantized.linear_dynamic(torch.cat([rows / size, self.pin]), self.packed, True)[:-1] * size
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
