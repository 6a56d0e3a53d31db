"""What a 7B target gains on this CPU: a Q4_K_M GGUF of Qwen2.5-7B's shapes with random weights, raced with the bundled
0.5B draft, through the same path a user's own GGUF pair takes (load_pair on two files).

python -m specdec_core.bench.cpu7b [--accept 0.6,0.8,0.9] [--acceptance-from FILE[::RUN]] [--peer]
    [--json docs/cpu-7b-bench.json]

- The file is written once to the cache (bench/, 4.7 GB): llama.cpp's Q4_K_M layout (Q6_K for the head, and for
  attn_v and ffn_down in the layers llama.cpp gives more bits), each weight's blocks a random matrix's, quantised once
  per shape and repeated down its rows, with the bundled target's tokenizer so that llama.cpp reads it too. Its
  vocabulary is the tokenizer's 151,936 tokens (Qwen2.5-7B pads its head to 152,064 rows).
- Measured: the target's step and passes (exact, on the file's blocks), the draft's step, so c; plain decoding; and
  speculative decoding at SIMULATED ACCEPTANCE: random models never agree, so each drafted token is accepted with
  probability a (bench.gpu.simulated). Drafting, passes, caches and rollbacks are real; only the verdict is drawn.
  Each run drafts the K that the measured costs say pays best at its a (theory.expected_speedup). The a's: those
  asked for, and the median of the bundled pair's per-prompt acceptance in a CPU bench run (--acceptance-from).
- --peer: llama.cpp's plain decoding of the same file, the same prompt tokens and number of new tokens, on the same
  threads, its prompt timed apart (bench.peer).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from .. import SpecConfig, autoregressive_generate, generate, load_pair, speculative_generate, summarize
from ..models.files import DRAFT, TARGET, default_cache_dir
from ..models.kernels.kquant import quantise
from ..theory import expected_speedup
from ..timing import pass_ms, passes_ms
from .gpu import every_k, simulated
from .peer import INSTALL, LlamaCppPeer, joined_gguf

SHAPE = dict(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4)  # Qwen2.5-7B
PARTS = (("attn_q", "q"), ("attn_k", "kv"), ("attn_v", "kv"), ("attn_output", "h"), ("ffn_gate", "i"), ("ffn_up", "i"),
         ("ffn_down", "h"))
PASS_SIZES = tuple(range(2, 10))  # verifying 1..8 drafts


def more_bits(layer: int, layers: int) -> bool:
    """Where llama.cpp's Q4_K_M gives attn_v and ffn_down Q6_K: the first and last eighth, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def blocks_like(rows: int, k: int, kind: int, cache: dict) -> np.ndarray:
    """[rows, k] weights as `kind` (4 or 6) blocks: a random matrix of 256 rows scaled as an initialised layer's,
    quantised once per (k, kind) and repeated down the rows."""
    if (k, kind) not in cache:
        g = torch.Generator().manual_seed(k * 10 + kind)
        cache[k, kind] = quantise(torch.randn(256, k, generator=g) / k ** 0.5, kind).numpy()
    return np.resize(cache[k, kind], (rows, cache[k, kind].shape[1]))


def tensors(shape: dict, vocab: int) -> list[tuple[str, tuple[int, ...], int]]:
    """(GGUF name, PyTorch shape, kind: 4 Q4_K, 6 Q6_K, 0 float32) of every tensor, in the file's order."""
    h, i, heads, kv = shape["hidden"], shape["intermediate"], shape["heads"], shape["kv_heads"]
    out = {"q": h, "kv": h // heads * kv, "h": h, "i": i}
    rows = [("token_embd.weight", (vocab, h), 4)]
    for layer in range(shape["layers"]):
        for part, size in PARTS:
            k = i if part == "ffn_down" else h
            kind = 6 if part in ("attn_v", "ffn_down") and more_bits(layer, shape["layers"]) else 4
            rows.append((f"blk.{layer}.{part}.weight", (out[size], k), kind))
            if part in ("attn_q", "attn_k", "attn_v"):
                rows.append((f"blk.{layer}.{part}.bias", (out[size],), 0))
        rows += [(f"blk.{layer}.attn_norm.weight", (h,), 0), (f"blk.{layer}.ffn_norm.weight", (h,), 0)]
    return rows + [("output_norm.weight", (h,), 0), ("output.weight", (vocab, h), 6)]


def write_random(path: Path, shape: dict, tokenizer: Path) -> Path:
    """A random Q4_K_M file of `shape` with the tokenizer of the GGUF file `tokenizer` (once: kept where it was
    written)."""
    import gguf

    if path.exists():
        return path
    source = gguf.GGUFReader(tokenizer)
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    partial = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(partial, "qwen2")
    w.add_name("random weights")
    for key, value in (("block_count", shape["layers"]), ("context_length", 32768), ("embedding_length", shape["hidden"]),
                       ("feed_forward_length", shape["intermediate"]), ("attention.head_count", shape["heads"]),
                       ("attention.head_count_kv", shape["kv_heads"])):
        w.add_uint32(f"qwen2.{key}", value)
    w.add_float32("qwen2.rope.freq_base", 1e6)
    w.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-6)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), kind, sub)
    cache, plan = {}, tensors(shape, vocab)
    for name, dims, kind in plan:
        if kind:
            nbytes = dims[0] * dims[1] // 256 * (144 if kind == 4 else 210)
            w.add_tensor_info(name, (dims[0], nbytes // dims[0]), np.dtype(np.uint8), nbytes,
                              raw_dtype=gguf.GGMLQuantizationType.Q4_K if kind == 4 else gguf.GGMLQuantizationType.Q6_K)
        else:
            w.add_tensor_info(name, dims, np.dtype(np.float32), 4 * dims[0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, dims, kind in plan:  # one tensor in memory at a time
        if kind:
            w.write_tensor_data(blocks_like(dims[0], dims[1], kind, cache))
        else:
            w.write_tensor_data(np.full(dims, 1.0 if name.endswith("norm.weight") else 0.0, np.float32))
    w.close()
    partial.replace(path)
    return path


def best_k(a: float, c: float, passes: dict) -> tuple[int, float]:
    """The draft length that the measured costs say pays best at acceptance a, and its predicted speedup."""
    return max(((k, expected_speedup(a, k, c, passes[k + 1])) for k in range(1, max(passes))), key=lambda kv: kv[1])


def rate(stream) -> tuple[float, list]:
    events = list(stream)
    return summarize(events).decode_tokens_per_s, events


def measure(pair, args, accepts: dict) -> dict:
    ms = passes_ms(pair, "target", args.context, (1, *PASS_SIZES), reps=3, warm=1)
    step, draft_step = ms[1], pass_ms(pair, "draft", args.context, 1, reps=9)
    passes = {n: ms[n] / step for n in PASS_SIZES}
    c = draft_step / step
    prompt = torch.randint(0, pair.vocab, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    cfg = SpecConfig(max_new_tokens=args.max_new_tokens)
    plain, plain_events = rate(autoregressive_generate(pair, prompt, cfg))
    spec = generate(pair, prompt, cfg)  # the real verdicts of two random models: the output must be plain decoding's
    runs = {}
    for name, a in accepts.items():
        k, predicted = best_k(a, c, passes)
        tokens_per_s, events = rate(speculative_generate(pair, prompt, dataclasses.replace(cfg, k=k), every_k(pair),
                                                          judge=simulated(a)))
        runs[name] = {"a": a, "k": k, "tokens_per_s": tokens_per_s, "speedup": tokens_per_s / plain,
                      "predicted_speedup": predicted, "accepted_per_round": statistics.mean(e.accepted for e in events)}
        print(name, json.dumps(runs[name]), flush=True)
    return {"target_step_ms": step, "draft_step_ms": draft_step, "draft_cost_c": c, "pass_cost_vs_step": passes,
            "plain_tokens_per_s": plain, "plain_tokens": sum(len(e.committed) for e in plain_events),
            "greedy_identical": spec.token_ids == [t for e in plain_events for t in e.committed],
            "simulated": runs, "prompt": prompt}


def peer_run(path: Path, prompt: list[int], tokens: int, ours: float) -> dict:
    try:
        import llama_cpp
    except ImportError:
        return {"error": f"llama-cpp-python is not installed: {INSTALL}"}
    model = llama_cpp.Llama(model_path=str(path), n_threads=torch.get_num_threads(), n_ctx=2048, n_batch=512,
                            verbose=False)
    peer = LlamaCppPeer(frozenset(), model)
    out = peer.generate(prompt, SpecConfig(max_new_tokens=tokens), tokens)
    return {"version": getattr(llama_cpp, "__version__", ""), "threads": torch.get_num_threads(), "tokens": out["tokens"],
            "prompt_s": out["prompt_s"], "decode_tokens_per_s": out["decode_tokens_per_s"],
            "ours_over_llama_cpp": ours / out["decode_tokens_per_s"]}


def median_acceptance(source: str) -> float:
    """The median of each prompt's acceptance rate in a CPU bench run of the bundled pair: a bench JSON (its first
    variant), or FILE::NAME, the run NAME of a file of several runs ({"runs": {NAME: run}})."""
    path, _, name = source.partition("::")
    with open(path) as f:
        run = json.load(f)
    run = run["runs"][name] if name else run
    variant = list(run["variants"].values())[0] if "variants" in run else run
    return statistics.median(e["spec"]["acceptance_rate"] for e in variant["prompts"])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m specdec_core.bench.cpu7b", description=__doc__.split("\n")[0])
    ap.add_argument("--accept", default="0.6,0.8,0.9", help="simulated acceptance rates")
    ap.add_argument("--acceptance-from", default=None, help="a CPU bench JSON of the bundled pair: its median too")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--peer", action="store_true", help="llama.cpp's plain decoding of the same file")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    accepts = {f"a={a}": float(a) for a in args.accept.split(",")}
    if args.acceptance_from:
        accepts["bundled median"] = median_acceptance(args.acceptance_from)
    cache = Path(default_cache_dir())
    (cache / "bench").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    path = write_random(cache / "bench" / "random-qwen2.5-7b-shapes-q4_k_m.gguf", SHAPE, joined_gguf(TARGET, cache))
    written_s = time.perf_counter() - t0
    pair = load_pair(str(path), str(joined_gguf(DRAFT, cache)), device="cpu")
    pair = dataclasses.replace(pair, eos_ids=frozenset())  # every run writes as many tokens
    report = {"date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(), "context": args.context,
              "max_new_tokens": args.max_new_tokens, "target": f"random weights of Qwen2.5-7B's shapes, Q4_K_M "
              f"({path.stat().st_size / 1e9:.2f} GB)", "draft": DRAFT.name, "bundled_target": TARGET.name,
              "target_weights": pair.info.target_weights, "draft_weights": pair.info.draft_quant,
              "file_written_s": written_s,
              "note": "simulated: acceptance is drawn with probability a; kernels, caches and rounds are real",
              **measure(pair, args, accepts)}
    if args.peer:
        del pair
        report["llama_cpp"] = peer_run(path, report["prompt"], args.max_new_tokens, report["plain_tokens_per_s"])
    report["prompt"] = len(report["prompt"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps({k: v for k, v in report.items() if k != "simulated"}, indent=1))
    return report


if __name__ == "__main__":
    main()
