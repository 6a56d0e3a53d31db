"""The bundled pair: its cache, on a tiny stand-in (fast), and the real pair, its target exact int8 from float32 (slow)."""
import json

import pytest
import torch

from specdec_core import SpecConfig, generate, load_pair
from specdec_core.models import bundled
from specdec_core.models.tiny import tiny_models

from ..conftest import with_eos


@pytest.fixture(scope="module")
def bundled_pair():
    return load_pair("bundled", device="cpu", dtype="float32")


@pytest.mark.slow
@pytest.mark.bundled
@pytest.mark.parametrize("prompt", ["Write a Python function that checks whether a number is prime.",
                                    "Explain what a hash map is in two sentences."])
def test_greedy_speculative_equals_the_targets_own_greedy_output(bundled_pair, prompt):
    cfg, pair = SpecConfig(k=4, max_new_tokens=32), with_eos(bundled_pair, [])  # 32 tokens, wherever the answer ends
    ar = generate(pair, prompt, cfg, "autoregressive")
    spec = generate(pair, prompt, cfg)
    assert len(ar.token_ids) == 32
    assert spec.token_ids == ar.token_ids
    assert spec.stats.acceptance_rate > 0.3  # a real draft of the same family agrees most of the time


@pytest.mark.slow
@pytest.mark.bundled
@pytest.mark.parametrize("context", [128, 1030])
def test_the_default_target_gives_a_position_the_same_logits_in_a_step_and_in_any_pass(bundled_pair, context):
    """The CPU default (the exact int8 target): 17 positions fed one at a time, as plain decoding does, against the
    same positions in one chain pass, and a tree's branch against its tokens fed alone: equal bit for bit."""
    from .test_quant import logits_alone_and_in_a_pass

    assert bundled_pair.target.config._attn_implementation == "specdec_rows"
    alone, chain, branch, branch_alone = logits_alone_and_in_a_pass(bundled_pair.target, bundled_pair.vocab, context)
    assert torch.equal(alone, chain) and torch.equal(branch, branch_alone)


FAKE = bundled.BundledModel("fake", "fake", "none", 1, "0" * 64, 4)
NO_PROGRESS = lambda f, m: None  # noqa: E731


@pytest.fixture()
def fake_cache(tmp_path, monkeypatch):
    """A cache root whose "GGUF" is a tiny model: build() saves it, counting how often it runs."""
    target, _, tok = tiny_models()
    builds = []

    def build(gguf, folder, dtype):
        builds.append(folder.name)
        target.to(dtype).save_pretrained(folder)
        tok.save_pretrained(folder)

    monkeypatch.setattr(bundled, "assemble", lambda m, dest, progress: dest.write_bytes(b"GGUF"))
    load = lambda: bundled.load_model(FAKE, tmp_path, torch.bfloat16, NO_PROGRESS, build)  # noqa: E731
    return tmp_path, load, builds, target


def test_the_cache_is_built_once_in_the_dtype_used(fake_cache):
    root, load, builds, target = fake_cache
    model, folder = load()
    assert folder == root / "fake-bfloat16" and builds == ["fake-bfloat16.partial"]
    assert model.dtype == torch.bfloat16 and torch.equal(model.lm_head.weight, target.lm_head.weight.bfloat16())
    assert sorted(p.name for p in root.iterdir()) == ["fake-bfloat16"]  # no GGUF, no float32 copy, no leftovers
    for saved in ("draft-int4.safetensors", "target-int8.safetensors"):  # quantised weights kept beside it
        (folder / saved).write_bytes(b"checked on their own")
    load()
    assert len(builds) == 1


@pytest.mark.parametrize("damage", ["truncated", "garbled", "interrupted", "no manifest"])
def test_a_damaged_cache_is_rebuilt_never_loaded(fake_cache, damage):
    root, load, builds, target = fake_cache
    _, folder = load()
    weights = folder / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "garbled":  # same size, so only loading it can tell
        weights.write_bytes(b"x" * weights.stat().st_size)
    elif damage == "interrupted":  # a first start stopped while building: only the .partial folder is there
        folder.rename(folder.with_name(folder.name + ".partial"))
    else:
        (folder / "specdec.json").unlink()
    model, again = load()
    assert again == folder and len(builds) == 2
    assert torch.equal(model.lm_head.weight, target.lm_head.weight.bfloat16())
    assert not folder.with_name(folder.name + ".partial").exists()


def test_a_cache_of_the_first_layout_is_adopted_and_its_float32_copy_removed(fake_cache):
    root, load, builds, target = fake_cache
    stamp = json.dumps({"format": 1, "gguf_sha256": FAKE.sha256, "weights_bytes": 1})
    for name, dtype in (("fake", torch.float32), ("fake-bfloat16", torch.bfloat16)):  # as the first layout left them
        target.to(dtype).save_pretrained(root / name)
        (root / name / "specdec.json").write_text(stamp)
    model, folder = load()
    assert builds == [] and folder == root / "fake-bfloat16" and not (root / "fake").exists()
    assert json.loads((folder / "specdec.json").read_text())["format"] == bundled.FORMAT
    assert torch.equal(model.lm_head.weight, target.lm_head.weight.bfloat16())
