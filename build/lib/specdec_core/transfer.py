"""Moving values between the host and the device without making either wait more than once.

A synchronous host-to-device copy waits for every kernel already queued on a GPU, so in the middle of a
round it costs as much as a read: `upload` copies from pinned memory with non_blocking=True, queued like
a kernel. Reads go the other way, and each waits for the device: `Transfer` gathers what a round (or a
drafted level) needs into one.
"""
from __future__ import annotations

import math
import struct

import torch


def upload(data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of `data` (nested lists of numbers, or a host tensor) on `device`, queued, not waited for."""
    host = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if torch.device(device).type == "cuda" and host.device.type == "cpu":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class Transfer:
    """Device values packed by name into one int64 tensor and copied to the host in one read: integers as they
    are, floats as their float32 bits (exact, and MPS has no float64)."""

    def __init__(self):
        self.parts, self.fields = [], []

    def put(self, name: str, value: torch.Tensor, floats: bool = False) -> None:
        flat = value.reshape(-1)
        self.parts.append(flat.float().view(torch.int32).long() if floats else flat.long())
        self.fields.append((name, tuple(value.shape), floats))

    def read(self) -> dict:
        values = torch.cat(self.parts).tolist()  # the one device -> host transfer
        out, at = {}, 0
        for name, shape, floats in self.fields:
            n = math.prod(shape)
            part, at = values[at: at + n], at + n
            if floats:
                part = list(struct.unpack(f"{n}f", struct.pack(f"{n}i", *part)))
            out[name] = part[0] if not shape else part if len(shape) == 1 else \
                [part[i * shape[1]: (i + 1) * shape[1]] for i in range(shape[0])]
        return out
