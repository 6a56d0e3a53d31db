"""Cost ratios for a pair shaped like Qwen2.5-7B-Instruct (target) and Qwen2.5-0.5B-Instruct (draft).

python -m specdec_core.gpu_bench [--device cuda] [--shape 7b|tiny] [--graphs off,inductor] [--json docs/gpu-bench.json]

Random weights are enough for costs: for each way of running decoding steps (--graphs: uncompiled,
or compiled with CUDA graphs) it measures the target's one-token step, its verification pass for
K = 1, 3, 4, 7 (as a multiple of the step), the draft's step (c), and plain vs speculative tokens/s
through the engine, then the speedup the cost model predicts at a few acceptance rates. Random
models barely agree, so the measured speculative rate is a floor; greedy output must still be
identical to plain decoding, and the report says whether it was.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from . import SpecConfig, autoregressive_generate, generate, load_pair, speculative_generate, summarize
from .bench import first_divergence
from .cache import _STATIC, CachedModel
from .engine import Clock
from .models import enable_graphs, make_pair, pick_device
from .theory import expected_speedup, measured_costs
from .tiny import tiny_models, tiny_tokenizer

SHAPES = {  # (hidden, intermediate, layers, heads, kv heads, vocab rows)
    "7b": ((3584, 18944, 28, 28, 4, 152064), (896, 4864, 24, 14, 2, 151936)),
    "tiny": ((128, 256, 4, 4, 2, 259), (64, 128, 2, 4, 2, 259)),
}
VERIFY_K = (1, 3, 4, 7)


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
    for _ in range(reps + 3):  # the first calls compile, when compiled
        clock.lap()  # synchronised start
        lm.forward(x, keep=n)
        times.append(clock.lap())
        lm.crop(context - 1)
    return sorted(times[3:])[reps // 2] * 1000


def measure(pair, args, graphs: str) -> dict:
    for model in (pair.target, pair.draft):
        _STATIC.pop(model, None)
    t0 = time.perf_counter()
    if graphs != "off":
        enable_graphs(pair, graphs, max_len=args.context + args.max_new_tokens + 64)
    step = pass_ms(pair.target, pair.vocab, pair.device, args.context, 1)
    verify = {k: pass_ms(pair.target, pair.vocab, pair.device, args.context, k + 1) / step for k in VERIFY_K}
    c = pass_ms(pair.draft, pair.vocab, pair.device, args.context, 1) / step
    warm_s = time.perf_counter() - t0
    cfg = SpecConfig(k=4, max_new_tokens=args.max_new_tokens)
    prompt = list(range(1, args.context))
    generate(pair, prompt, dataclasses.replace(cfg, max_new_tokens=8))  # compile the remaining shapes
    ar, spec = (generate(pair, prompt, cfg, m) for m in ("autoregressive", "speculative"))
    a, c_run, v_run = measured_costs(ar.stats, spec.stats)
    race = race_rates(pair, prompt, cfg)
    return {
        "graphs": graphs, "target_step_ms": step, "verify_cost_vs_step": verify, "draft_cost_c": c,
        "measure_and_compile_s": warm_s,
        "plain_tokens_per_s": ar.stats.decode_tokens_per_s, "spec_tokens_per_s": spec.stats.decode_tokens_per_s,
        "spec_acceptance_rate": a, "greedy_identical": ar.token_ids == spec.token_ids,
        "first_divergence": first_divergence(pair, prompt, ar.token_ids, spec.token_ids),
        "measured_vs_predicted": (spec.stats.decode_tokens_per_s / ar.stats.decode_tokens_per_s)
        / expected_speedup(a, cfg.k, c_run, v_run),
        "race_tokens_per_s": race,
        "predicted_speedup_k4": {str(x): expected_speedup(x, 4, c, verify[4]) for x in (0.6, 0.8, 0.9)},
    }


def race_rates(pair, prompt, cfg) -> dict:
    """The app's race: both decoders take turns, a round each, on one target (each with its own cache)."""
    streams = {"plain": autoregressive_generate(pair, prompt, cfg), "spec": speculative_generate(pair, prompt, cfg)}
    events = {name: [] for name in streams}
    while streams:
        for name, stream in list(streams.items()):
            event = next(stream, None)
            if event is None:
                del streams[name]
            else:
                events[name].append(event)
    return {name: summarize(e).decode_tokens_per_s for name, e in events.items()}


def local_dir_check(device) -> dict:
    """The app's path for hub pairs (load_pair on directories), in bfloat16, with its default graphs."""
    target, draft, tok = tiny_models()
    with tempfile.TemporaryDirectory() as root:
        for name, model in (("target", target), ("draft", draft)):
            model.save_pretrained(f"{root}/{name}")
            tok.save_pretrained(f"{root}/{name}")
        pair = load_pair(f"{root}/target", f"{root}/draft", device=str(device), dtype="bfloat16")
    pair = dataclasses.replace(pair, eos_ids=frozenset())
    greedy = SpecConfig(k=4, max_new_tokens=40)
    sampled = generate(pair, "hello", dataclasses.replace(greedy, temperature=1.0))
    return {"graphs": pair.info.get("graphs", "off"), "dtype": str(pair.dtype),
            "greedy_identical": generate(pair, "hello", greedy).token_ids
            == generate(pair, "hello", greedy, "autoregressive").token_ids,
            "sampled_tokens": len(sampled.token_ids)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m specdec_core.gpu_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--graphs", default="off,inductor", help="comma list of: off, cudagraphs, inductor")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=420, help="skip the remaining variants after this long")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device, dtype = pick_device(args.device), getattr(torch, args.dtype)
    start = time.perf_counter()
    torch.manual_seed(0)
    t_shape, d_shape = SHAPES[args.shape]
    target, draft = random_model(t_shape, device, dtype), random_model(d_shape, device, dtype)
    # a byte-level tokenizer is enough to drive random models; no EOS, so every run has the same length
    pair = dataclasses.replace(make_pair(f"random {args.shape}", target, draft, tiny_tokenizer(), device, dtype),
                               eos_ids=frozenset())
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else str(device), "dtype": args.dtype,
        "shape": args.shape, "context": args.context, "max_new_tokens": args.max_new_tokens,
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "variants": [],
    }
    for graphs in args.graphs.split(","):
        if time.perf_counter() - start > args.budget_s:
            report["variants"].append({"graphs": graphs, "skipped": "time budget"})
            continue
        try:
            report["variants"].append(measure(pair, args, graphs))
        except Exception as err:  # report it and go on with the next variant
            report["variants"].append({"graphs": graphs, "error": repr(err)[:500]})
        print(json.dumps(report["variants"][-1]), flush=True)
        if args.json:  # after every variant, so a run cut short still leaves its numbers
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
    del pair, target, draft
    report["local_dir_check"] = local_dir_check(device)
    report["seconds"] = time.perf_counter() - start
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
