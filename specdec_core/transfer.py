"""Host data onto the device without making the host wait.

A synchronous host-to-device copy waits for every kernel already queued on a GPU, so in the middle of a
round it costs as much as a read. Copies from pinned memory with non_blocking=True are queued like kernels.
"""
from __future__ import annotations

import torch


def upload(data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of `data` (nested lists of numbers, or a host tensor) on `device`, queued, not waited for."""
    host = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if torch.device(device).type == "cuda" and host.device.type == "cpu":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
