"""Cost ratios for a pair shaped like Qwen2.5-7B-Instruct (target) and Qwen2.5-0.5B-Instruct (draft).

python -m specdec_core.gpu_bench [--device cuda] [--shape 7b|tiny] [--json docs/gpu-bench.json]

Random weights are enough for costs: it measures the target's one-token step, its K+1-token
verification pass for K = 1..8 (as a multiple of the step), the draft's step (c), and plain vs
speculative tokens/s through the engine, then the speedup the cost model predicts at a few
acceptance rates. (Random models barely agree, so the measured speculative rate is a floor.)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from . import SpecConfig, generate
from .cache import CachedModel
from .engine import Clock
from .models import make_pair, pick_device
from .theory import expected_speedup
from .tiny import tiny_tokenizer

SHAPES = {  # (hidden, intermediate, layers, heads, kv heads, vocab rows)
    "7b": ((3584, 18944, 28, 28, 4, 152064), (896, 4864, 24, 14, 2, 151936)),
    "tiny": ((128, 256, 4, 4, 2, 259), (64, 128, 2, 4, 2, 259)),
}


def random_model(shape, device, dtype):
    hidden, inter, layers, heads, kv, vocab = shape
    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=False)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Qwen2ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(previous)


def pass_ms(model, vocab, device, context: int, n: int, reps: int = 10) -> float:
    lm = CachedModel(model, vocab)
    lm.prefill(list(range(1, context)))
    x = torch.ones(n, dtype=torch.long, device=device)
    clock, times = Clock(device), []
    for _ in range(reps + 2):
        clock.lap()  # synchronised start
        lm.forward(x, keep=n)
        times.append(clock.lap())
        lm.crop(context - 1)
    return sorted(times[2:])[reps // 2] * 1000


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m specdec_core.gpu_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device, dtype = pick_device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    t_shape, d_shape = SHAPES[args.shape]
    target, draft = random_model(t_shape, device, dtype), random_model(d_shape, device, dtype)
    vocab = min(t_shape[-1], d_shape[-1])
    step = pass_ms(target, vocab, device, args.context, 1)
    verify = {k: pass_ms(target, vocab, device, args.context, k + 1) / step for k in range(1, 9)}
    c = pass_ms(draft, vocab, device, args.context, 1) / step
    # a byte-level tokenizer is enough to drive random models; no EOS, so every run has the same length
    pair = dataclasses.replace(make_pair(f"random {args.shape}", target, draft, tiny_tokenizer(), device, dtype),
                               eos_ids=frozenset())
    cfg = SpecConfig(k=4, max_new_tokens=args.max_new_tokens)
    ar, spec = (generate(pair, "benchmark " * 8, cfg, m) for m in ("autoregressive", "speculative"))
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else str(device), "dtype": args.dtype,
        "shape": args.shape, "context": args.context, "date": time.strftime("%Y-%m-%d"),
        "target_step_ms": step, "verify_cost_vs_step": verify, "draft_cost_c": c,
        "plain_tokens_per_s": ar.stats.decode_tokens_per_s, "spec_tokens_per_s": spec.stats.decode_tokens_per_s,
        "spec_acceptance_rate": spec.stats.acceptance_rate,
        "predicted_speedup_k4": {a: expected_speedup(a, 4, c, verify[4]) for a in (0.6, 0.8, 0.9)},
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
