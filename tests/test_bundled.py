"""The real bundled pair (Qwen2.5-Coder 1.5B target, 0.5B draft; GGUF Q4_K_M dequantised), float32."""
import pytest

from specdec_core import SpecConfig, generate, load_pair


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
