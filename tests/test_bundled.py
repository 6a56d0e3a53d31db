"""The real bundled pair (Qwen2.5-Coder 1.5B target, 0.5B draft; GGUF Q4_K_M dequantised), float32."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec_core import SpecConfig, generate, load_pair
from specdec_core.bundled import in_dtype
from specdec_core.tiny import tiny_models


@pytest.fixture(scope="module")
def bundled():
    return load_pair("bundled", device="cpu", dtype="float32")


@pytest.mark.parametrize("prompt", ["Write a Python function that checks whether a number is prime.",
                                    "Explain what a hash map is in two sentences."])
def test_greedy_speculative_equals_the_targets_own_greedy_output(bundled, prompt):
    cfg = SpecConfig(k=4, max_new_tokens=32)
    ar = generate(bundled, prompt, cfg, "autoregressive")
    spec = generate(bundled, prompt, cfg)
    assert len(ar.token_ids) == 32
    assert spec.token_ids == ar.token_ids
    assert spec.stats.acceptance_rate > 0.3  # a real draft of the same family agrees most of the time


def test_a_bfloat16_copy_is_made_once_and_redone_when_the_weights_change(tmp_path):
    target, _, tok = tiny_models()
    src = tmp_path / "model"
    target.save_pretrained(src)
    tok.save_pretrained(src)
    (src / "specdec.json").write_text('{"format": 1}')
    assert in_dtype(src, torch.float32, lambda f, m: None) == src
    out = in_dtype(src, torch.bfloat16, lambda f, m: None)
    weights = out / "model.safetensors"
    copy = AutoModelForCausalLM.from_pretrained(out)
    assert copy.dtype == torch.bfloat16 and (out / "tokenizer.json").exists()
    assert torch.equal(copy.lm_head.weight, target.lm_head.weight.bfloat16())
    made = weights.stat().st_mtime_ns
    assert in_dtype(src, torch.bfloat16, lambda f, m: None) == out and weights.stat().st_mtime_ns == made
    (src / "specdec.json").write_text('{"format": 2}')
    in_dtype(src, torch.bfloat16, lambda f, m: None)
    assert (out / "specdec.json").read_text() == '{"format": 2}'
