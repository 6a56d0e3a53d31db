"""A decoding round reads from the device once: a GPU never waits for the host in the middle of one."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specdec_core import SpecConfig, autoregressive_generate, speculative_generate
from specdec_core.drafters import ModelDrafter

from .conftest import with_eos

READ_METHODS = ("tolist", "item", "numpy")


class DeviceReads(TorchDispatchMode):
    """Counts what makes the host wait for the device: scalar reads (int(), float(), bool(), .item()),
    copies to the CPU from another device, and .tolist() / .numpy() (not dispatched on the CPU itself)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.count = 0
        for name in READ_METHODS:
            method = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self.counted(method))

    def counted(self, method):
        def read(tensor, *args, **kwargs):
            self.count += 1
            return method(tensor, *args, **kwargs)
        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            dst = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device", src.device)
            self.count += src.device.type != "cpu" and torch.device(dst).type == "cpu"
        return func(*args, **kwargs)


def reads_per_round(monkeypatch, stream) -> list[int]:
    """Device reads in each round after the first (the first also holds the prompt's prefill)."""
    next(stream)
    counts = []
    with DeviceReads(monkeypatch) as reads:
        while True:
            before = reads.count
            if next(stream, None) is None:
                break
            counts.append(reads.count - before)
    monkeypatch.undo()
    return counts


CONFIGS = [SpecConfig(k=4, max_new_tokens=40), SpecConfig(k=6, max_new_tokens=40, temperature=1.0, top_p=0.9, seed=2),
           SpecConfig(k=8, max_new_tokens=40, min_confidence=0.5, record_top=5)]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_a_speculative_round_reads_the_device_once(tiny, monkeypatch, cfg):
    pair = with_eos(tiny, [])
    drafter = ModelDrafter(pair.cached("draft"), cut_on_device=True)  # as on a GPU
    counts = reads_per_round(monkeypatch, speculative_generate(pair, "one read a round", cfg, drafter))
    assert len(counts) > 3 and counts == [1] * len(counts)


def test_a_plain_decoding_step_reads_the_device_once(tiny, monkeypatch):
    counts = reads_per_round(monkeypatch, autoregressive_generate(with_eos(tiny, []), "plain", SpecConfig(max_new_tokens=12)))
    assert counts == [1] * 11


def test_the_counter_sees_a_cpu_draft_reading_its_confidence_each_step(tiny, monkeypatch):
    pair = with_eos(tiny, [])
    cfg = SpecConfig(k=8, max_new_tokens=40, min_confidence=0.5)
    cpu_drafter = lambda: ModelDrafter(pair.cached("draft"), cut_on_device=False)  # stops drafting early
    events = list(speculative_generate(pair, "one read a round", cfg, cpu_drafter()))[1:]
    counts = reads_per_round(monkeypatch, speculative_generate(pair, "one read a round", cfg, cpu_drafter()))
    assert counts == [1 + len(e.drafted) for e in events]
