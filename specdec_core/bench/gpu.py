"""GPU costs and speeds from random weights of real shapes: no checkpoint has to reach the GPU.

python -m specdec_core.bench.gpu [--shapes 7b,1.5b] [--graphs inductor] [--k 4] [--accept 0.6,0.8,0.9]
    [--acceptance-from docs/bench-cpu.json] [--json docs/gpu-bench.json]

For each pair shape (7b: Qwen2.5-7B's target with Qwen2.5-0.5B's draft; 1.5b: the bundled pair's
shapes) and each way of running decoding steps (--graphs: off, or compiled with CUDA graphs):
- the target's one-token step, its n-token passes (verifying n - 1 drafts, or a tree of n - 1
  nodes) as multiples of the step, the draft's step as a multiple (c), and the share of the
  memory bandwidth a step uses (weight bytes read / step time / --peak-tbs);
- plain decoding through the engine, and whether greedy speculative output is identical to it; compiled, the target
  runs at one shape (every step fed at 32 rows: exact), and plain decoding at each step's own size is timed beside it
  (`plain_tokens_per_s_unconstrained`: what exactness costs);
- SIMULATED ACCEPTANCE. Random models never agree, so the target's verdict is replaced by a draw in
  which every drafted token is accepted with probability a. Drafting, the verification pass, the
  caches and their rollback are all real; only the accept/reject outcome is drawn. Each round drafts
  k tokens (no cut on the random draft's confidence), as the prediction assumes. Measured
  tokens/s against what the cost model predicts from the measured c and verify cost, at each a,
  and at the acceptance rates the bundled pair really had per prompt (--acceptance-from: a CPU
  bench JSON);
- the app's race (both decoders taking turns on one target) at the middle a asked for, against the
  same decoders run alone: the race must show the same ratio;
- token trees of 16, 32 and 64 nodes: their pass's cost, and the speedup predicted at the tokens a
  tree accepted a pass and the depth it reached on the bundled pair (when the --acceptance-from run
  has a tree variant: `python -m specdec_core.bench --tree 0,16`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from .. import SpecConfig, autoregressive_generate, generate, load_pair, speculative_generate, summarize
from ..drafters import ModelDrafter
from ..models import enable_graphs, make_pair, pick_device
from ..models.tiny import tiny_models, tiny_tokenizer
from ..race import race
from ..theory import expected_speedup
from ..timing import pass_ms, passes_ms
from ..verify import Decision, accepted_prefix

SHAPES = {  # (hidden, intermediate, layers, heads, kv heads, vocab rows), target then draft
    "7b": ((3584, 18944, 28, 28, 4, 152064), (896, 4864, 24, 14, 2, 151936)),
    "1.5b": ((1536, 8960, 28, 12, 2, 151936), (896, 4864, 24, 14, 2, 151936)),
    "tiny": ((128, 256, 4, 4, 2, 259), (64, 128, 2, 4, 2, 259)),
}
PASS_SIZES = (2, 5, 9, 17, 33, 65)  # tokens scored in one target pass: 1, 4, 8, 16, 32, 64 drafts


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


def simulated(a: float):
    """A verdict that accepts each drafted token with probability a, whatever the models say; the
    target's token after them is its own argmax. For costs only: the output is not the target's."""
    def judge(x, parents, q, p, generator=None):  # a chain's: the GPU bench drafts chains
        k = x.numel()
        uniforms = torch.rand(k, generator=generator, device=p.device)
        n, rejected = accepted_prefix(uniforms < a)
        dist = p.index_select(0, n.view(1))[0]
        rows = torch.arange(k, device=p.device)
        return Decision(n, dist.argmax(), torch.full((k,), a, device=p.device), uniforms, rejected, dist, rows < n,
                        p[rows, x])
    return judge


def weight_bytes(model) -> int:
    """What one decoding step reads: every weight but the input embedding (one row of it)."""
    skip = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not skip)


def decode_rate(stream) -> tuple[float, list]:
    events = list(stream)
    return summarize(events).decode_tokens_per_s, events


def every_k(pair) -> ModelDrafter:
    """The draft model drafting K every round (no costs, so no policy cut): what is measured is K at the drawn
    acceptance, beside the cost model's prediction for K."""
    return ModelDrafter(pair.cached("draft"))


def race_rates(pair, prompt, cfg, judge) -> dict:
    """The app's race: both decoders take turns on one target, the one behind on its own clock next."""
    streams = {"plain": autoregressive_generate(pair, prompt, cfg),
               "spec": speculative_generate(pair, prompt, cfg, every_k(pair), judge=judge)}
    return {name: summarize(e).decode_tokens_per_s for name, e in race(streams).items()}


def measure(pair, args, graphs: str, accepts: dict[str, float], race_at: str, tree: dict | None = None) -> dict:
    pair.compiled.clear()
    t0 = time.perf_counter()
    if graphs != "off":
        pair = enable_graphs(pair, graphs, max_len=args.context + args.max_new_tokens + 96)
    ms = passes_ms(pair, "target", args.context, (1, *PASS_SIZES))
    step, draft_step = ms[1], pass_ms(pair, "draft", args.context, 1)
    passes = {n: ms[n] / step for n in PASS_SIZES}
    compile_s = time.perf_counter() - t0
    c = draft_step / step
    # no cut on the draft's confidence: a random draft's is always low, and the drawn verdicts ignore it
    cfg = SpecConfig(k=args.k, max_new_tokens=args.max_new_tokens, min_confidence=0.0)
    prompt = list(range(1, args.context))
    generate(pair, prompt, dataclasses.replace(cfg, max_new_tokens=8))  # the remaining shapes, compiled now
    plain, plain_events = decode_rate(autoregressive_generate(pair, prompt, cfg))
    _, spec_events = decode_rate(speculative_generate(pair, prompt, cfg, every_k(pair)))
    ids = lambda events: [t for e in events for t in e.committed]
    v = lambda k: passes[k + 1] if k + 1 in passes else 1 + (passes[5] - 1) * k / 4
    runs = {}
    for name, a in accepts.items():
        rate, events = decode_rate(speculative_generate(pair, prompt, cfg, every_k(pair), judge=simulated(a)))
        predicted = plain * expected_speedup(a, args.k, c, v(args.k))
        runs[name] = {"a": a, "tokens_per_s": rate, "speedup": rate / plain, "predicted_tokens_per_s": predicted,
                      "measured_over_predicted": rate / predicted,
                      "accepted_per_round": statistics.mean(e.accepted for e in events)}
    unconstrained = plain_at_any_shape(pair, prompt, cfg) if graphs != "off" else None
    race = race_rates(pair, prompt, cfg, simulated(accepts[race_at]))
    # plain decoding alone again, after the race: tells first-use costs of the earlier runs from the race's clocks
    plain_after, _ = decode_rate(autoregressive_generate(pair, prompt, cfg))
    trees = {}
    if tree:  # a tree of n nodes: `depth` draft forwards of up to TREE_WIDTH tokens, one pass of n + 1
        for n in (16, 32, 64):
            cost = tree["depth"] * c + passes[n + 1]
            trees[n] = {"pass_cost_vs_step": passes[n + 1], "predicted_speedup": (1 + tree["accepted"]) / cost}
    return {
        "graphs": graphs, "target_step_ms": step, "draft_step_ms": draft_step, "draft_cost_c": c,
        "pass_cost_vs_step": passes, "measure_and_compile_s": compile_s,
        "bandwidth_share": {role: weight_bytes(getattr(pair, role)) / (ms / 1000) / (args.peak_tbs * 1e12)
                            for role, ms in (("target", step), ("draft", draft_step))},
        "plain_tokens_per_s": plain, "greedy_identical": ids(plain_events) == ids(spec_events),
        # what exactness costs: the target's steps at one shape (above) against each at its own padded size
        "plain_tokens_per_s_unconstrained": unconstrained,
        "one_shape": getattr(pair.compiled.get("target"), "width", None),
        "simulated": runs,
        "trees": trees,
        "race": {"a": accepts[race_at], "plain_tokens_per_s": race["plain"], "spec_tokens_per_s": race["spec"],
                 "plain_alone_after_tokens_per_s": plain_after,
                 "speedup": race["spec"] / race["plain"], "speedup_alone": runs[race_at]["speedup"],
                 "simulated": f"the verdicts drawn with probability a={accepts[race_at]:g}, not judged by the models"},
    }


def plain_at_any_shape(pair, prompt, cfg) -> float:
    """Plain decoding with the target's steps fed at their own padded sizes, not at one shape (load.enable_graphs):
    what the exactness of one shape costs. The sizes compiled first, outside the timing."""
    static = pair.compiled["target"]
    width, static.width = static.width, None
    try:
        generate(pair, prompt, dataclasses.replace(cfg, max_new_tokens=8), "autoregressive")
        return decode_rate(autoregressive_generate(pair, prompt, cfg))[0]
    finally:
        static.width = width


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
    return {"graphs": pair.info.graphs or "off", "dtype": str(pair.dtype),
            "greedy_identical": generate(pair, "hello", greedy).token_ids
            == generate(pair, "hello", greedy, "autoregressive").token_ids,
            "sampled_tokens": len(sampled.token_ids)}


def table(report: dict) -> str:
    rows = [f"{'shape':<6}{'graphs':<10}{'step ms':>8}{'c':>6}{'BW %':>6}{'5-pass':>7}{'17-pass':>8}{'65-pass':>8}"
            f"{'plain tok/s':>12}  simulated a: measured / predicted tok/s (speedup)"]
    for v in report["variants"]:
        if "error" in v or "skipped" in v:
            rows.append(f"{v['shape']:<6}{v['graphs']:<10}{v.get('error') or v.get('skipped')}")
            continue
        p = v["pass_cost_vs_step"]
        sims = "; ".join(f"{name}: {r['tokens_per_s']:.0f} / {r['predicted_tokens_per_s']:.0f} ({r['speedup']:.2f}x)"
                         for name, r in v["simulated"].items())
        rows.append(f"{v['shape']:<6}{v['graphs']:<10}"
                    f"{v['target_step_ms']:>8.2f}{v['draft_cost_c']:>6.2f}"
                    f"{100 * v['bandwidth_share']['target']:>5.0f}%{p[5]:>7.2f}{p[17]:>8.2f}{p[65]:>8.2f}"
                    f"{v['plain_tokens_per_s']:>12.1f}  {sims}")
        r = v["race"]
        rows.append(f"{'':<16}race at simulated a={r['a']:g}: {r['speedup']:.2f}x (alone {r['speedup_alone']:.2f}x); plain "
                    f"{r['plain_tokens_per_s']:.1f} tok/s in the race, {v['plain_tokens_per_s']:.1f} alone before it, "
                    f"{r['plain_alone_after_tokens_per_s']:.1f} after")
        if v["trees"]:
            rows.append(f"{'':<16}trees, predicted at the bundled pair's tokens a pass: " + "; ".join(
                f"{n} nodes {t['pass_cost_vs_step']:.2f} steps, {t['predicted_speedup']:.2f}x" for n, t in v["trees"].items()))
    return "\n".join(rows)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m specdec_core.bench.gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--shapes", default="7b,1.5b", help=f"comma list of: {', '.join(SHAPES)}")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--graphs", default="inductor", help="comma list of: off, inductor (eager: tests)")
    ap.add_argument("--k", type=int, default=SpecConfig().k, help="drafts per round in the simulated runs")
    ap.add_argument("--accept", default="0.6,0.8,0.9", help="simulated acceptance rates")
    ap.add_argument("--acceptance-from", default=None, help="a CPU bench JSON: also simulate each prompt's acceptance")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=SpecConfig().max_new_tokens)
    ap.add_argument("--peak-tbs", type=float, default=4.8, help="the device's memory bandwidth, TB/s (H200: 4.8)")
    ap.add_argument("--budget-s", type=float, default=420, help="skip the remaining variants after this long")
    ap.add_argument("--json", default=None)
    return ap


def measured_acceptance(path: str, accepts: dict) -> dict | None:
    """Each prompt's acceptance in a CPU bench run, added to `accepts`; and, where that run drafted trees, their
    tokens accepted a pass and depth ({"accepted", "depth"}, else None)."""
    with open(path) as f:
        run = json.load(f)
    variants = list(run["variants"].values()) if "variants" in run else [run]
    accepts.update({e["id"]: e["spec"]["acceptance_rate"] for e in variants[0]["prompts"]})  # the first target's
    trees = next((v for v in variants if v["settings"].get("tree_nodes")), None)
    return trees and {"accepted": trees["summary"]["accepted_per_pass_mean"], "depth": trees["summary"]["depth_per_round_mean"]}


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    device, dtype = pick_device(args.device), getattr(torch, args.dtype)
    accepts = {f"a={a}": float(a) for a in args.accept.split(",")}
    race_at = list(accepts)[len(accepts) // 2]  # the middle rate asked for
    tree = measured_acceptance(args.acceptance_from, accepts) if args.acceptance_from else None
    start = time.perf_counter()
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else str(device), "dtype": args.dtype,
              "context": args.context, "max_new_tokens": args.max_new_tokens, "k": args.k, "peak_tbs": args.peak_tbs,
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "variants": [],
              "note": "simulated: acceptance is drawn with probability a; kernels, caches and rounds are real"}

    def save():
        if args.json:  # after every variant, so a run cut short still leaves its numbers
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)

    for shape in args.shapes.split(","):
        torch.manual_seed(0)
        t_shape, d_shape = SHAPES[shape]
        target, draft = random_model(t_shape, device, dtype), random_model(d_shape, device, dtype)
        # a byte-level tokenizer is enough to drive random models; no EOS, so every run has the same length
        pair = dataclasses.replace(make_pair(f"random {shape}", target, draft, tiny_tokenizer(), device, dtype),
                                   eos_ids=frozenset())
        for graphs in args.graphs.split(","):
            entry = {"shape": shape, "graphs": graphs}
            if time.perf_counter() - start > args.budget_s:
                entry["skipped"] = "time budget"
            else:
                try:
                    entry.update(measure(pair, args, graphs, accepts, race_at, tree))
                except Exception as err:  # report it and go on with the next variant
                    entry["error"] = repr(err)[:500]
            report["variants"].append(entry)
            print(json.dumps(entry), flush=True)
            save()
        del pair, target, draft
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["local_dir_check"] = local_dir_check(device)
    report["seconds"] = time.perf_counter() - start
    save()
    print(table(report))
    return report


if __name__ == "__main__":
    main()
