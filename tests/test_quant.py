"""A cheaper draft (int8 weights, pruned head) changes acceptance only, never the output."""
import copy
import dataclasses

import pytest
import torch

from specdec_core import SpecConfig, generate
from specdec_core.quant import (DynamicInt8Linear, Int8Linear, PackedLinear, PrunedHead, can_pack, cheapen_draft,
                                load_saved, pack_linears)

from .conftest import with_eos


def test_int8_linear_is_close_to_the_original():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(3, 64)
    q = Int8Linear(lin)
    assert q.weight.dtype == torch.int8 and q.scales.shape == (32,)
    err = (q(x) - lin(x)).abs().max() / lin(x).abs().max()
    assert 0 < err < 0.02


def test_pruned_head_masks_the_tail():
    head = torch.nn.Linear(8, 10, bias=False)
    pruned = PrunedHead(head, keep=6, vocab=10)
    out = pruned(torch.randn(2, 8))
    assert out.shape == (2, 10) and torch.isinf(out[:, 6:]).all() and torch.isfinite(out[:, :6]).all()
    assert pruned.weight.shape[0] == 10


def test_cheapened_draft_stays_lossless(tiny):
    pair = with_eos(tiny, [])
    cheap = dataclasses.replace(pair, draft=cheapen_draft(copy.deepcopy(pair.draft), int8=True, keep_vocab=128))
    cfg = SpecConfig(k=4, max_new_tokens=40)
    out = generate(cheap, "hello there", cfg)
    assert out.token_ids == generate(pair, "hello there", cfg, "autoregressive").token_ids
    assert all(t < 128 for e in out.events for t in e.drafted)  # the pruned head never proposes the tail
    sampled = generate(cheap, "hello there", SpecConfig(k=4, max_new_tokens=40, temperature=1.0, seed=3))
    assert len(sampled.token_ids) == 40


def test_packed_linears_give_the_same_logits(tiny):
    model = copy.deepcopy(tiny.target).to(torch.bfloat16)
    if not can_pack(model):
        pytest.fail("oneDNN is not available in this torch build")
    ids = torch.tensor([[5, 9, 33, 101, 7]])
    with torch.inference_mode():
        before = model(ids).logits
        pack_linears(model)
        after = model(ids).logits
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_dynamic_int8_draft_keeps_down_proj_weight_only(tiny):
    draft = cheapen_draft(copy.deepcopy(tiny.draft).to(torch.bfloat16), int8=True)
    kinds = {name.rsplit(".", 1)[-1]: type(m) for name, m in draft.named_modules()
             if isinstance(m, (Int8Linear, DynamicInt8Linear))}
    assert kinds["down_proj"] is Int8Linear and kinds["gate_proj"] is DynamicInt8Linear
    assert kinds["lm_head"] is DynamicInt8Linear
    fp32 = cheapen_draft(copy.deepcopy(tiny.draft).float())  # the weight-only kernel is slow in float32
    assert type(fp32.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert isinstance(fp32.model.layers[0].mlp.up_proj, DynamicInt8Linear)
    for mode, down, gate in (("dynamic", DynamicInt8Linear, DynamicInt8Linear), ("weight-only", Int8Linear, Int8Linear)):
        other = cheapen_draft(copy.deepcopy(tiny.draft).to(torch.bfloat16), mode=mode)
        assert isinstance(other.model.layers[0].mlp.down_proj, down)
        assert isinstance(other.model.layers[0].mlp.gate_proj, gate)
    with torch.inference_mode():
        out = draft(torch.tensor([[5, 9, 33]])).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_int8_draft_is_the_same_draft_and_stale_files_are_rebuilt(tiny, tmp_path, dtype):
    x = torch.tensor([[5, 17, 42, 99, 7]])
    path = tmp_path / "int8-mixed.safetensors"
    fresh = cheapen_draft(copy.deepcopy(tiny.draft).to(dtype), saved=path, source="weights v1")
    assert path.exists()
    for damage in (None, "other source", "corrupt"):
        if damage == "corrupt":
            path.write_bytes(b"not a safetensors file")
        reloaded = cheapen_draft(copy.deepcopy(tiny.draft).to(dtype), saved=path,
                                 source="weights v2" if damage == "other source" else "weights v1")
        with torch.inference_mode():
            assert torch.equal(fresh(x).logits, reloaded(x).logits)
    assert load_saved(path, "weights v1")  # the corrupt file was rewritten
