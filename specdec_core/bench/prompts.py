"""Benchmark: plain vs speculative decoding (and transformers' assisted generation) on a prompt set.

python -m specdec_core.bench --pair bundled --json out.json [--compare-hf] [--peer llama.cpp] [--repeats 2]
    [--k 16] [--min-confidence 0.65] [--max-new-tokens 128] ... (SpecConfig's defaults) [--drafter model]

Speeds are compared as ratios measured in the same run, after a warm-up, over as many tokens: sampled, plain decoding
writes as many as the speculative run drew.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform
import re
import resource
import statistics
import time
from pathlib import Path

import torch

from .. import SpecConfig, autoregressive_generate, generate, load_pair, make_drafter, speculative_generate
from ..drafters import DRAFTERS
from ..engine import encode_request
from ..models import LoadOptions, dtype_name, first_divergence
from ..events import summarize
from ..race import race as run_race
from ..theory import measured_costs, predicted_speedup
from .costs import costs_by_context, draft_step_table
from .chart import chart
from .peer import agreeing, hf_assisted

NOT_FLAGS = ("chat", "record_top", "tree_nodes", "guess")  # SpecConfig's fields that are not flags (--tree, --guess: lists)
STAT_KEYS = ("tokens", "seconds", "tokens_per_s")
OWN_KEYS = STAT_KEYS + ("prefill_s", "decode_tokens_per_s")
SPEC_KEYS = OWN_KEYS + ("acceptance_rate", "accepted_fraction", "mean_accepted_length", "tokens_per_round",
                         "draft_s", "verify_s", "overhead_s", "rounds", "plain_steps")


def pick(stats, keys) -> dict:
    return {k: getattr(stats, k) for k in keys}


def run_prediction(ar, spec, cfg) -> float:
    """What the cost model predicts from this run's own measurements (acceptance, step times) for
    the draft lengths it used; for trees, from the draft's own expectation of each tree and the rounds' cost."""
    a, c, v = measured_costs(ar.stats, spec.stats)
    if cfg.tree_nodes:  # a round costs its draft (c per node drafted) and its pass
        rounds = spec.stats.rounds
        return (1 + sum(e.expected for e in spec.events) / rounds) / (c * spec.stats.drafted / rounds + v)
    return predicted_speedup(a, [len(e.drafted) for e in spec.events], c, v)


def fastest(runs: list, seconds) -> object:
    """The fastest of repeated runs: on a shared machine, noise only ever adds time."""
    return min(runs, key=seconds)


def raced(pair, ids: list[int], cfg: SpecConfig, drafter_name: str) -> dict:
    """The app's race (race.interleave, as app/race.py runs it): both decoders take turns on one target, the one behind
    on its own clock next; each lane's stats, as the page shows them."""
    streams = {"ar": autoregressive_generate(pair, ids, cfg),
               "spec": speculative_generate(pair, ids, cfg, make_drafter(pair, drafter_name, cfg))}
    return {name: summarize(lane) for name, lane in run_race(streams).items()}


def timed_runs(pair, ids, cfg, drafter_name, compare_hf, hf_k, repeats, peer, race) -> tuple[list, ...]:
    """Each method's runs of the prompt `ids`, `repeats` times, interleaved: plain, speculative, transformers' assisted
    generation, the peer and the app's race, as asked. Every plain and speculative run writes as many tokens."""
    ars, specs, hfs, peers, races = [], [], [], [], []
    alike, alike_cfg = pair, cfg
    if not cfg.greedy:  # the decoders draw answers of their own lengths: every run writes as many as the first drew
        specs.append(generate(pair, ids, cfg, drafter=make_drafter(pair, drafter_name, cfg)))
        alike = dataclasses.replace(pair, eos_ids=frozenset(), pass_costs=pair.costs())
        alike_cfg = dataclasses.replace(cfg, max_new_tokens=len(specs[0].token_ids))
    for repeat in range(repeats):  # interleaved, so that a slow spell of the machine hits every method
        ars.append(generate(alike, ids, alike_cfg, "autoregressive"))
        if len(specs) <= repeat:
            specs.append(generate(alike, ids, alike_cfg, drafter=make_drafter(alike, drafter_name, alike_cfg)))
        if compare_hf:
            hfs.append([hf_assisted(pair, ids, cfg, constant_k) for constant_k in (0, hf_k)])
        if peer is not None:  # as many tokens as ours wrote
            peers.append(peer.generate(ids, cfg, len(ars[-1].token_ids)))
        if race:
            races.append(raced(pair, ids, cfg, drafter_name))
    return ars, specs, hfs, peers, races


def run_prompt(pair, item, cfg, drafter_name, compare_hf, hf_k, repeats=1, peer=None, race=False) -> dict:
    ids = encode_request(pair, item["prompt"], cfg)
    ars, specs, hfs, peers, races = timed_runs(pair, ids, cfg, drafter_name, compare_hf, hf_k, repeats, peer, race)
    ar, spec = fastest(ars, lambda r: r.stats.seconds), fastest(specs, lambda r: r.stats.seconds)
    entry = {"id": item["id"], "category": item.get("category", ""), "prompt_tokens": len(ids),
             "ar": pick(ar.stats, OWN_KEYS),
             "spec": {**pick(spec.stats, SPEC_KEYS), "drafted_per_round": spec.stats.drafted / spec.stats.rounds,
                      "depth_per_round": statistics.mean(e.depth for e in spec.events),
                      "draft_steps_per_round": statistics.mean(e.draft_steps for e in spec.events)},
             "speedup": spec.stats.tokens_per_s / ar.stats.tokens_per_s,
             "decode_speedup": spec.stats.decode_tokens_per_s / ar.stats.decode_tokens_per_s,
             "predicted_speedup": run_prediction(ar, spec, cfg),
             "identical_to_ar": ar.token_ids == spec.token_ids,
             "seconds_of_repeats": {"ar": [r.stats.seconds for r in ars], "spec": [r.stats.seconds for r in specs]},
             "tokens_of_repeats": {"ar": [r.stats.tokens for r in ars], "spec": [r.stats.tokens for r in specs]}}
    priced = [e.step_ms for e in spec.events if e.step_ms]
    if priced:  # the target's step that the policy priced rounds against, beside the plain run's own (median)
        entry["step_ms"] = {"plain": 1000 * statistics.median(e.verify_s for e in ar.events),
                            "priced": statistics.median(priced)}
    if not entry["identical_to_ar"] and cfg.greedy:  # sampled outputs differ by design: exact in distribution
        entry["first_divergence"] = first_divergence(pair, ids, ar.token_ids, spec.token_ids)
    if compare_hf:
        runs = [fastest(list(schedule), lambda r: r["seconds"]) for schedule in zip(*hfs)]
        best = max(runs, key=lambda r: r["tokens_per_s"])
        entry["hf_assisted"] = {k: best[k] for k in STAT_KEYS + ("schedule",)}
        entry["hf_runs"] = [{k: r[k] for k in STAT_KEYS + ("schedule",)} for r in runs]
        entry["hf_identical_to_ar"] = best["token_ids"][: len(ar.token_ids)] == ar.token_ids
        entry["speedup_vs_hf"] = spec.stats.tokens_per_s / best["tokens_per_s"]
    if races:  # the race's figures beside the decoders' run alone
        best = fastest(races, lambda r: r["ar"].seconds + r["spec"].seconds)
        entry["race"] = {"ar_tokens": best["ar"].tokens, "spec_tokens": best["spec"].tokens,
                         "ar_tokens_per_s": best["ar"].tokens_per_s, "spec_tokens_per_s": best["spec"].tokens_per_s,
                         "speedup": best["spec"].tokens_per_s / best["ar"].tokens_per_s,
                         "ar_over_alone": best["ar"].tokens_per_s / ar.stats.tokens_per_s,
                         "spec_over_alone": best["spec"].tokens_per_s / spec.stats.tokens_per_s}
    if peers:  # another engine's numerics: its greedy output is its own, recorded, not expected to match
        best = fastest(peers, lambda r: r["seconds"])
        entry["peer"] = {k: best[k] for k in STAT_KEYS + ("prompt_s", "decode_tokens_per_s")} | {"name": peer.name}
        entry["peer_agreeing_tokens"] = agreeing(best["token_ids"], ar.token_ids)
        # decoding against decoding: the same token count, each engine's prompt time apart
        entry["speedup_vs_peer"] = spec.stats.decode_tokens_per_s / best["decode_tokens_per_s"]
        entry["ar_vs_peer"] = ar.stats.decode_tokens_per_s / best["decode_tokens_per_s"]
    return entry


def summarize_prompts(entries: list[dict]) -> dict:
    med = lambda key: statistics.median(e[key] for e in entries)
    out = {"speedup_median": med("speedup"), "speedup_min": min(e["speedup"] for e in entries),
           "spec_tokens_per_s_median": statistics.median(e["spec"]["tokens_per_s"] for e in entries),
           "ar_tokens_per_s_median": statistics.median(e["ar"]["tokens_per_s"] for e in entries),
           "decode_speedup_median": med("decode_speedup"), "predicted_speedup_median": med("predicted_speedup"),
           "measured_over_predicted_median": statistics.median(e["decode_speedup"] / e["predicted_speedup"]
                                                               for e in entries),
           "acceptance_rate_median": statistics.median(e["spec"]["acceptance_rate"] for e in entries),
           "accepted_per_pass_mean": statistics.mean(e["spec"]["mean_accepted_length"] for e in entries),
           "drafted_per_round_mean": statistics.mean(e["spec"]["drafted_per_round"] for e in entries),
           "depth_per_round_mean": statistics.mean(e["spec"]["depth_per_round"] for e in entries),
           "draft_steps_per_round_mean": statistics.mean(e["spec"]["draft_steps_per_round"] for e in entries),
           "identical": sum(e["identical_to_ar"] for e in entries), "prompts": len(entries)}
    if all("step_ms" in e for e in entries):
        out["priced_over_plain_step_median"] = statistics.median(e["step_ms"]["priced"] / e["step_ms"]["plain"]
                                                                 for e in entries)
    if all("speedup_vs_hf" in e for e in entries):
        out["speedup_vs_hf_median"] = med("speedup_vs_hf")
        out["hf_speedup_median"] = statistics.median(e["hf_assisted"]["tokens_per_s"] / e["ar"]["tokens_per_s"]
                                                     for e in entries)
    if all("speedup_vs_peer" in e for e in entries):
        out["peer_tokens_per_s_median"] = statistics.median(e["peer"]["tokens_per_s"] for e in entries)
        out["speedup_vs_peer_median"] = med("speedup_vs_peer")
        out["speedup_vs_peer_min"] = min(e["speedup_vs_peer"] for e in entries)
        out["ar_vs_peer_median"] = med("ar_vs_peer")
    if all("race" in e for e in entries):
        for key in ("ar_over_alone", "spec_over_alone", "speedup"):
            out[f"race_{key}_median"] = statistics.median(e["race"][key] for e in entries)
    return out


def table(report: dict) -> str:
    peer = all("peer" in e for e in report["prompts"])
    rows = [f"{'prompt':<20}{'AR tok/s':>9}{'spec tok/s':>11}{'speedup':>8}{'decode':>7}{'pred.':>7}{'accept':>7}"
            f"{'acc/rnd':>8}{'HF tok/s':>9}{'vs HF':>7}" + (f"{'tokens':>8}{'peer dec/s':>11}{'vs peer':>8}{'AR/peer':>8}{'agree':>6}" if peer else "") + "  same"]
    for e in report["prompts"]:
        hf = e.get("hf_assisted")
        rows.append(f"{e['id']:<20}{e['ar']['tokens_per_s']:>9.2f}{e['spec']['tokens_per_s']:>11.2f}"
                    f"{e['speedup']:>7.2f}x{e['decode_speedup']:>6.2f}x{e['predicted_speedup']:>6.2f}x"
                    f"{e['spec']['acceptance_rate']:>7.2f}"
                    f"{e['spec']['mean_accepted_length']:>8.2f}"
                    + (f"{hf['tokens_per_s']:>9.2f}{e['speedup_vs_hf']:>6.2f}x" if hf else f"{'-':>9}{'-':>7}")
                    + (f"{e['ar']['tokens']:>4}/{e['peer']['tokens']:<3}{e['peer']['decode_tokens_per_s']:>11.2f}"
                       f"{e['speedup_vs_peer']:>7.2f}x{e['ar_vs_peer']:>7.2f}x{e['peer_agreeing_tokens']:>6}" if peer else "")
                    + ("  yes" if e["identical_to_ar"] else "  sampled: another draw" if "first_divergence" not in e
                       else f"  near-tie at {e['first_divergence']['position']} "
                       f"(gap {e['first_divergence']['logprob_gap']:.3f})"))
    s = report["summary"]
    rows.append(f"median speedup {s['speedup_median']:.2f}x (min {s['speedup_min']:.2f}x), "
                f"{s['spec_tokens_per_s_median']:.1f} against {s['ar_tokens_per_s_median']:.1f} tok/s; decode phase "
                f"{s['decode_speedup_median']:.2f}x vs predicted {s['predicted_speedup_median']:.2f}x "
                f"(ratio {s['measured_over_predicted_median']:.2f}); identical {s['identical']}/{s['prompts']}"
                + (f", vs HF assisted {s['speedup_vs_hf_median']:.2f}x" if "speedup_vs_hf_median" in s else "")
                + (f"; decoding against {report['peer']}'s plain decoding of as many tokens, prompts apart: "
                   f"{s['speedup_vs_peer_median']:.2f}x median (min {s['speedup_vs_peer_min']:.2f}x), our plain "
                   f"{s['ar_vs_peer_median']:.2f}x" if "speedup_vs_peer_median" in s else "")
                + (f"; in the app's race, against alone: plain {s['race_ar_over_alone_median']:.2f}, speculative "
                   f"{s['race_spec_over_alone_median']:.2f}, speedup {s['race_speedup_median']:.2f}x"
                   if "race_speedup_median" in s else ""))
    return "\n".join(rows)


def options(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m specdec_core.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default="bundled", help="bundled | tiny | TARGET_ID,DRAFT_ID")
    ap.add_argument("--prompts", default=str(Path(__file__).with_name("prompts.jsonl")),
                    help="a JSONL file of prompts, or a comma list of them (heldout.jsonl beside it: prompts kept out of tuning)")
    for name, kind, default, help in SpecConfig.options(skip=NOT_FLAGS):  # as SpecConfig says them
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            ap.add_argument(flag, action="store_true", help=help)
        else:
            ap.add_argument(flag, type=kind, default=default, help=f"{help} (default {default})")
    ap.add_argument("--drafter", default=DRAFTERS[0], choices=DRAFTERS)
    ap.add_argument("--json", default="bench.json")
    ap.add_argument("--png", default=None, help="speedup chart (default: next to the JSON)")
    ap.add_argument("--compare-hf", action="store_true")
    ap.add_argument("--hf-k", type=int, default=4, help="transformers' constant schedule drafts this many")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts")
    ap.add_argument("--only", default="", help="comma list of prompt ids or categories (e.g. portuguese)")
    ap.add_argument("--repeats", type=int, default=1, help="run each method this many times; keep the fastest")
    ap.add_argument("--draft-quant", default="int4", choices=["int4", "off"],
                    help="the draft on CPUs: int4 (int8 where the int4 product does not fit), or as loaded")
    ap.add_argument("--target-quant", default="auto",
                    help="the target: auto (on CPUs: the bundled one on its GGUF's blocks, others int8), off (as loaded), "
                         "blocks or int8; a comma list compares them in one run")
    ap.add_argument("--peer", default="none", choices=["none", "llama.cpp"],
                    help="also time llama.cpp's plain decoding of the bundled target's GGUF (needs llama-cpp-python)")
    ap.add_argument("--contexts", default="",
                    help="comma list of context lengths: time a step and a pass at each, the contexts in turn, and a prompt of that length")
    ap.add_argument("--draft-table", action="store_true", help="time where a draft step goes, part by part")
    ap.add_argument("--race", action="store_true", help="also run each prompt as the app's race (both decoders taking "
                    "turns on one target) and set its figures beside theirs alone")
    ap.add_argument("--tree", default="0",
                    help="draft token trees of up to this many nodes (0: a chain); a comma list compares them in one run")
    ap.add_argument("--guess", default=str(SpecConfig.guess),
                    help="guesses a chain's draft step checks (0: none); a comma list compares them in one run")
    args = ap.parse_args(argv)
    if args.peer != "none" and args.pair != "bundled":
        raise SystemExit("--peer llama.cpp decodes the bundled target's GGUF: use it with --pair bundled")
    return args


def load_variants(args, cfg: SpecConfig, prompt: str) -> tuple[dict, dict, dict]:
    """Each target asked for (its own pair) with each tree size: {variant: pair}, {variant: cfg}, {variant: load s},
    each warmed up on `prompt` (first calls pay for allocations and kernel selection; a tree's pass costs are timed)."""
    target, _, draft = args.pair.partition(",")
    trees = [int(n) for n in args.tree.split(",")]
    guesses = [int(n) for n in args.guess.split(",")]
    pairs, cfgs, load_s = {}, {}, {}
    for quant in args.target_quant.split(","):
        t0 = time.perf_counter()
        pair = load_pair(target, draft or None, LoadOptions(
            device=args.device, dtype=args.dtype, target_quant=quant, draft_quant="auto" if args.draft_quant == "int4" else False))
        quant = pair.info.target_quant  # "auto" resolved
        for nodes, guess in itertools.product(trees, guesses):
            variant = ", ".join([quant] + [f"tree of {nodes}" if nodes else "chain"] * (len(trees) > 1)
                                + [f"guess {guess}"] * (len(guesses) > 1))
            pairs[variant] = pair
            cfgs[variant] = dataclasses.replace(cfg, tree_nodes=nodes, guess=guess)
            load_s[variant] = time.perf_counter() - t0
            warm = dataclasses.replace(cfgs[variant], max_new_tokens=8)
            generate(pair, prompt, warm, "autoregressive")
            generate(pair, prompt, warm, drafter=make_drafter(pair, args.drafter, cfgs[variant]))
            if args.compare_hf:
                hf_assisted(pair, encode_request(pair, prompt, warm), warm, args.hf_k)
    return pairs, cfgs, load_s


def describe(pair, cfg: SpecConfig, args) -> dict:
    """What a variant's report says of the models, the machine and the settings it ran, and the costs timed once a
    process that each answer's rounds start from (the policy prices passes and drafts from the rounds after that): a
    shared machine's state moves them, and how far the rounds draft with them."""
    return {"pair": pair.name, "models": {"target": pair.info.target, "draft": pair.info.draft},
            "device": str(pair.device), "dtype": dtype_name(pair.dtype),
            "target_weights": pair.info.target_weights,
            "cpu_kernels": {k: getattr(pair.info, k) for k in ("draft_quant", "draft_int4", "packed", "target_int8")
                            if getattr(pair.info, k)},
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip() + f", {torch.get_num_threads()} threads",
            "settings": {**dataclasses.asdict(cfg), "drafter": args.drafter, "hf_k": args.hf_k, "repeats": args.repeats,
                         "target_quant": pair.info.target_quant, "prompts": args.prompts},
            "pass_costs": dataclasses.asdict(pair.costs())}


def print_report(reports: dict) -> None:
    for variant, one in reports.items():
        print(f"{variant}: target weights {one['target_weights']}\n{table(one)}")
        for context, costs in (one["costs_by_context"] or {}).items():
            print(f"context {context}: " + ", ".join(f"{key} {value:.1f}" for key, value in costs.items() if value))
        if one["draft_step"]:
            d = one["draft_step"]
            print(f"draft step {d['step_ms']:.2f} ms (target step {d['target_step_ms']:.2f} ms): "
                  + ", ".join(f"{name} {v['ms']:.2f} ms / {v['mb']:.0f} MB" for name, v in d["parts"].items()))
    if len(reports) > 1:
        print(f"{'variant':<24}{'median speedup':>15}{'drafted/round':>14}{'draft steps/round':>18}{'accepted/pass':>14}")
        for variant, one in reports.items():
            s = one["summary"]
            print(f"{variant:<24}{s['speedup_median']:>14.2f}x{s['drafted_per_round_mean']:>14.2f}"
                  f"{s['draft_steps_per_round_mean']:>18.2f}{s['accepted_per_pass_mean']:>14.2f}")


def main(argv=None) -> dict:
    args = options(argv)
    cfg = SpecConfig(**{name: getattr(args, name) for name, *_ in SpecConfig.options(skip=NOT_FLAGS)})
    items = [json.loads(line) for path in args.prompts.split(",") for line in Path(path).read_text().splitlines()
             if line.strip()]
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    items = [item for item in items if not only or only & {item["id"], item["category"]}]
    items = items[: args.limit] if args.limit else items
    if not items:
        raise SystemExit(f"no prompt in {args.prompts} is among {sorted(only)}")
    pairs, cfgs, load_s = load_variants(args, cfg, items[0]["prompt"])  # runs interleave prompt by prompt
    peer = None
    if args.peer == "llama.cpp":
        from .peer import LlamaCppPeer
        first = next(iter(pairs.values()))
        peer = LlamaCppPeer(first.eos_ids)
        peer.generate(encode_request(first, items[0]["prompt"], cfg), cfg, tokens=8)
    extra = {}  # per pair loaded (a target): the costs by context and the draft's table, timed before the prompts run
    for pair in {id(pair): pair for pair in pairs.values()}.values():  # once each, whatever variants share it
        extra[id(pair)] = {
            "costs_by_context": costs_by_context(pair, [int(c) for c in args.contexts.split(",")], cfg.k)
            if args.contexts else None,
            "draft_step": draft_step_table(pair) if args.draft_table and pair.draft is not None else None}
    entries = {variant: [] for variant in pairs}
    for item in items:
        for variant, pair in pairs.items():
            entries[variant].append(run_prompt(pair, item, cfgs[variant], args.drafter, args.compare_hf, args.hf_k,
                                               args.repeats, peer, args.race))
            e = entries[variant][-1]
            race = e.get("race")
            print(f"{e['id']} ({variant}): {e['speedup']:.2f}x, {e['spec']['tokens_per_s']:.1f} tok/s, "
                  f"acceptance {e['spec']['acceptance_rate']:.2f}" + (
                      f"; race {race['spec_tokens_per_s']:.1f} / {race['ar_tokens_per_s']:.1f} tok/s "
                      f"({race['speedup']:.2f}x) against alone {e['spec']['tokens_per_s']:.1f} / "
                      f"{e['ar']['tokens_per_s']:.1f}" if race else ""), flush=True)
    reports = {variant: {**describe(pair, cfgs[variant], args), **extra[id(pair)],
                         "peer": peer and f"{peer.name} {peer.version} (plain decoding of the target's GGUF, Q4_K_M)",
                         "load_s": load_s[variant], "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                         "prompts": entries[variant], "summary": summarize_prompts(entries[variant])}
               for variant, pair in pairs.items()}
    report = next(iter(reports.values())) if len(reports) == 1 else {"variants": reports}
    Path(args.json).write_text(json.dumps(report, indent=2))
    for variant, one in reports.items():
        png = Path(args.png) if args.png else Path(args.json).with_suffix(".png")
        slug = re.sub(r"[^a-z0-9]+", "-", variant.lower()).strip("-")
        chart(one, png if len(reports) == 1 else png.with_name(f"{png.stem}-{slug}{png.suffix}"))
    print_report(reports)
    return report


if __name__ == "__main__":
    main()
