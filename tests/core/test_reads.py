"""A decoding round reads from the device once, and copies host data to it only without waiting: a GPU never
waits for the host in the middle of one. Counted on the CPU, through the same operations a GPU would run."""
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specdec_core import SpecConfig, autoregressive_generate, speculative_generate
from specdec_core.cache import CachedModel
from specdec_core.drafters import ModelDrafter
from specdec_core.models import enable_graphs

from ..conftest import PRODUCTION_CHECK, with_eos

READ_METHODS = ("tolist", "item", "numpy")
# ops that hand a device value to the host: scalar reads (int(), float(), bool(), .item()), comparisons returning a bool
READ_OPS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default, torch.ops.aten.allclose.default)


class DeviceReads(TorchDispatchMode):
    """Counts what makes the host wait for the device: scalar reads, torch.equal / torch.allclose, copies to the
    CPU from another device, and .tolist() / .numpy() (not dispatched on the CPU itself). `uploads` counts
    synchronous copies of host data to a device: torch.tensor(..., device=...), and .to() of a tensor built from
    host data without non_blocking=True (on the CPU these copy nothing: they stand for what a GPU would wait on)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.count = self.uploads = 0
        for name in READ_METHODS:
            method = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self.counted(method))
        make, move = torch.tensor, torch.Tensor.to

        def tensor(*args, **kwargs):
            out = make(*args, **kwargs)
            if kwargs.get("device") is not None:
                self.uploads += 1
            else:
                out.from_host = True  # built from host data
            return out

        def to(t, *args, **kwargs):
            if getattr(t, "from_host", False) and not kwargs.get("non_blocking", False):
                self.uploads += 1
            return move(t, *args, **kwargs)

        monkeypatch.setattr(torch, "tensor", tensor)
        monkeypatch.setattr(torch.Tensor, "to", to)

    def counted(self, method):
        def read(tensor, *args, **kwargs):
            self.count += 1
            return method(tensor, *args, **kwargs)
        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READ_OPS:
            self.count += 1
        elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            dst = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device", src.device)
            self.count += src.device.type != "cpu" and torch.device(dst).type == "cpu"
        return func(*args, **kwargs)


def per_round(monkeypatch, stream) -> tuple[list[int], list[int]]:
    """Device reads and synchronous uploads in each round after the first (the first also holds the prefill),
    with the caches checked as in production (the tests' own check reads static caches' lengths)."""
    monkeypatch.setattr(CachedModel, "check", PRODUCTION_CHECK)
    next(stream)
    reads, uploads = [], []
    with DeviceReads(monkeypatch) as counter:
        while True:
            before = counter.count, counter.uploads
            if next(stream, None) is None:
                break
            reads.append(counter.count - before[0])
            uploads.append(counter.uploads - before[1])
    monkeypatch.undo()
    return reads, uploads


CONFIGS = [SpecConfig(k=4, max_new_tokens=40), SpecConfig(k=6, max_new_tokens=40, temperature=1.0, top_p=0.9, seed=2),
           SpecConfig(k=8, max_new_tokens=40, min_confidence=0.5, record_top=5),
           SpecConfig(k=4, max_new_tokens=40, tree_nodes=7), SpecConfig(k=4, max_new_tokens=40, tree_nodes=7, record_top=5),
           SpecConfig(k=4, max_new_tokens=40, temperature=1.0, seed=1, tree_nodes=7)]


def gpu_drafter(pair):
    return ModelDrafter(pair.cached("draft"), cut_on_device=True, expand=4)  # as on a GPU


def counting_forwards(drafter) -> list[int]:
    """Wraps the drafter's model: the list grows by one at each draft forward."""
    calls, forward = [], drafter.lm.forward
    drafter.lm.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    return calls


def expected_reads(pair, cfg) -> list[int]:
    """A chain round: one read. A tree round: one for the verdict, and one a drafted level, where the host
    chooses which branches to grow (nothing else in the round reads, however many nodes the tree has)."""
    drafter = gpu_drafter(pair)
    forwards = counting_forwards(drafter)
    events, levels = [], []
    for event in speculative_generate(pair, "one read a round", cfg, drafter):
        events.append(event)
        levels.append(len(forwards))
        forwards.clear()
    if cfg.tree_nodes:  # real trees: some rounds with siblings, and some judged past the root
        assert any(e.parents and len(set(e.parents)) < len(e.parents) for e in events)
        assert any(e.accepted for e in events)
    return [1 + (n if cfg.tree_nodes and e.drafted else 0) for n, e in zip(levels[1:], events[1:])]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_a_speculative_round_reads_the_device_once(tiny, monkeypatch, cfg):
    pair = with_eos(tiny, [])
    expected = expected_reads(pair, cfg)
    reads, uploads = per_round(monkeypatch, speculative_generate(pair, "one read a round", cfg, gpu_drafter(pair)))
    assert len(reads) > 3 and reads == expected
    assert uploads == [0] * len(uploads)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[1], CONFIGS[3]])
def test_static_caches_read_the_device_once_a_round(tiny, monkeypatch, cfg, uncompiled):
    """The GPU path's static caches keep their length on the device; checking it every round would read it."""
    pair = dataclasses.replace(with_eos(tiny, []), compiled={}, info=dataclasses.replace(tiny.info))  # the session's pair stays as it is
    pair = enable_graphs(pair, "eager", max_len=256)
    try:
        expected = expected_reads(pair, cfg)
        reads, uploads = per_round(monkeypatch, speculative_generate(pair, "one read a round", cfg, gpu_drafter(pair)))
    finally:
        for model in (pair.target, pair.draft):
            model.set_attn_implementation("sdpa")
    assert len(reads) > 3 and reads == expected
    assert uploads == [0] * len(uploads)


def test_a_plain_decoding_step_reads_the_device_once(tiny, monkeypatch):
    reads, uploads = per_round(monkeypatch, autoregressive_generate(with_eos(tiny, []), "plain",
                                                                    SpecConfig(max_new_tokens=12)))
    assert reads == [1] * 11 and uploads == [0] * 11


def test_the_counter_sees_a_cpu_draft_reading_its_confidence_each_step(tiny, monkeypatch):
    pair = with_eos(tiny, [])
    cfg = SpecConfig(k=8, max_new_tokens=40, min_confidence=0.5)
    cpu_drafter = lambda: ModelDrafter(pair.cached("draft"), cut_on_device=False)  # stops drafting early
    events = list(speculative_generate(pair, "one read a round", cfg, cpu_drafter()))[1:]
    reads, _ = per_round(monkeypatch, speculative_generate(pair, "one read a round", cfg, cpu_drafter()))
    assert reads == [1 + len(e.drafted) for e in events]


def test_the_counter_sees_comparisons_and_synchronous_uploads(monkeypatch):
    a = torch.ones(3)
    with DeviceReads(monkeypatch) as counter:
        torch.equal(a, a)
        torch.allclose(a, a)
        torch.tensor([1, 2], device="cpu")
        torch.tensor([1, 2]).to("cpu")
        torch.tensor([1, 2]).to("cpu", non_blocking=True)  # not counted: it need not wait
    monkeypatch.undo()
    assert (counter.count, counter.uploads) == (2, 2)
