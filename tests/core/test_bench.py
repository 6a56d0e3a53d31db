"""The benchmark CLIs run end to end on the tiny pair (their numbers are checked only for shape and sense)."""
import copy
import dataclasses
import json

import pytest
import torch

from specdec_core import SpecConfig, load_pair
from specdec_core.bench import gpu as gpu_bench
from specdec_core.bench import peer
from specdec_core.bench import prompts as bench
from specdec_core.engine import encode_request
from specdec_core.models.kernels import int8_vnni
from specdec_core.models.quant import draft_to_int4
from specdec_core.models.step import DraftStep
from specdec_core.models.tiny import NOMINAL_COSTS

from ..conftest import with_eos


def test_bench_writes_json_and_table(tmp_path, capsys):
    out = tmp_path / "b.json"
    report = bench.main(["--pair", "tiny", "--max-new-tokens", "12", "--limit", "2", "--json", str(out),
                         "--compare-hf", "--dtype", "float32", "--device", "cpu", "--repeats", "2"])
    data = json.loads(out.read_text())
    assert data["summary"]["prompts"] == 2 and data == json.loads(json.dumps(report))
    for e in data["prompts"]:
        assert e["identical_to_ar"] and e["ar"]["tokens"] == e["spec"]["tokens"]
        for method in ("ar", "spec"):  # the fastest of the repeats is the one reported
            assert len(e["seconds_of_repeats"][method]) == 2 and e[method]["seconds"] == min(e["seconds_of_repeats"][method])
        assert {"hf_assisted", "speedup_vs_hf", "predicted_speedup", "decode_speedup"} <= set(e)
    assert (tmp_path / "b.html").exists()
    assert "median speedup" in capsys.readouterr().out


def test_a_sampled_prompts_plain_decoding_writes_as_many_tokens_as_its_speculative_run(tiny):
    """Like for like under sampling: the two decoders draw answers of their own lengths, so plain decoding writes as
    many tokens as the speculative run did (past its own end of sequence), in every repeat."""
    pair = with_eos(tiny, range(0, tiny.vocab, 5))  # a fifth of the tokens end an answer: lengths differ by draw
    cfg = SpecConfig(temperature=1.0, max_new_tokens=40, seed=3)
    ids = encode_request(pair, "x", cfg)
    natural = [len(bench.generate(pair, ids, cfg, "autoregressive").token_ids),
               len(bench.generate(pair, ids, cfg, drafter=bench.make_drafter(pair, "model", cfg)).token_ids)]
    assert natural[0] != natural[1] and max(natural) < 40  # this draw: two lengths, each ended by its own draw
    e = bench.run_prompt(pair, {"id": "x", "prompt": "x"}, cfg, "model", False, 4, repeats=2)
    assert e["ar"]["tokens"] == e["spec"]["tokens"] == natural[1]
    assert e["tokens_of_repeats"] == {"ar": [natural[1]] * 2, "spec": [natural[1]] * 2}


def test_each_prompt_sets_the_step_the_policy_priced_beside_the_plain_runs(tiny):
    """Where the target's step was timed, the bench puts the step each round was priced against beside the plain
    run's own (medians): a policy whose unit drifts from the machine's step prices every round wrongly. Rounds of one
    drafted token here: their passes of two tokens say what a step takes (policy.Policy.passed)."""
    cfg, item = SpecConfig(k=1, max_new_tokens=24), {"id": "x", "prompt": "x"}
    slow = dataclasses.replace(NOMINAL_COSTS, step_ms=1000.0)  # timed at a second: the first pass corrects it
    e = bench.run_prompt(dataclasses.replace(tiny, pass_costs=slow, eos_ids=frozenset()), item, cfg, "model", False, 4)
    assert 0 < e["step_ms"]["priced"] < 1000.0 and e["step_ms"]["plain"] > 0
    assert 0 <= e["spec"]["plain_steps"] < e["spec"]["rounds"]  # rounds where drafting would not pay, counted
    assert bench.summarize_prompts([e, e])["priced_over_plain_step_median"] == e["step_ms"]["priced"] / e["step_ms"]["plain"]
    untimed = bench.run_prompt(dataclasses.replace(tiny, eos_ids=frozenset()), item, cfg, "model", False, 4)
    assert "step_ms" not in untimed and "priced_over_plain_step_median" not in bench.summarize_prompts([untimed])


@pytest.mark.slow  # a comparison of whole bench runs; test_bench_writes_json_and_table is the fast tier's
def test_bench_sets_the_apps_race_beside_the_decoders_alone(tmp_path, capsys):
    report = bench.main(["--pair", "tiny", "--max-new-tokens", "12", "--limit", "2", "--json", str(tmp_path / "r.json"),
                         "--race"])
    for e in report["prompts"]:
        race = e["race"]
        assert race["ar_tokens"] == e["ar"]["tokens"] == 12 and race["spec_tokens"] == e["spec"]["tokens"]  # both ran out
        assert race["ar_tokens_per_s"] > 0 and race["spec_tokens_per_s"] > 0
        assert race["spec_over_alone"] == race["spec_tokens_per_s"] / e["spec"]["tokens_per_s"]
    assert report["summary"]["race_speedup_median"] > 0
    assert "in the app's race, against alone" in capsys.readouterr().out


@pytest.mark.slow  # two variants, each through every simulated rate and the race
def test_gpu_bench_runs_on_a_small_shape(tmp_path):
    cpu_run = tmp_path / "cpu.json"  # per-prompt acceptance as the CPU bench writes it
    prompts = [{"id": "code", "spec": {"acceptance_rate": 0.7}}]  # as the CPU bench writes them, chain and tree
    cpu_run.write_text(json.dumps({"variants": {
        "off, chain": {"settings": {"tree_nodes": 0}, "prompts": prompts},
        "off, tree of 16": {"settings": {"tree_nodes": 16}, "prompts": prompts,
                            "summary": {"accepted_per_pass_mean": 3.0, "depth_per_round_mean": 5.0}}}}))
    # "eager": the compiled-step path (static caches, padded sizes, dynamo) without a compiler backend
    report = gpu_bench.main(["--shapes", "tiny", "--device", "cpu", "--dtype", "float32", "--context", "32",
                             "--max-new-tokens", "24", "--graphs", "off,eager",
                             "--accept", "0.5,0.9", "--k", "4",
                             "--acceptance-from", str(cpu_run), "--json", str(tmp_path / "gpu.json")])
    assert [v["graphs"] for v in report["variants"]] == ["off", "eager"]  # the GPU run's variants
    for v in report["variants"]:
        assert v["target_step_ms"] > 0 and set(v["pass_cost_vs_step"]) == set(gpu_bench.PASS_SIZES)
        assert v["plain_tokens_per_s"] > 0 and v["greedy_identical"]
        compiled = v["graphs"] != "off"  # the target at one shape, and plain decoding at any shape timed beside it
        assert (v["one_shape"] == 32, v["plain_tokens_per_s_unconstrained"] is not None) == (compiled, compiled)
        runs = v["simulated"]
        assert list(runs) == ["a=0.5", "a=0.9", "code"] and runs["code"]["a"] == 0.7
        # the drawn verdicts really steer the rounds: more accepted per round at a higher a
        assert runs["a=0.5"]["accepted_per_round"] < runs["a=0.9"]["accepted_per_round"] <= 4
        # and each round drafts the k tokens the prediction assumes (0.9 + 0.9² + 0.9³ + 0.9⁴ = 3.1 accepted a round),
        # not as few as a random draft's confidence would leave it (the cut: one, so about 0.9)
        assert runs["a=0.9"]["accepted_per_round"] > 2
        assert all(r["tokens_per_s"] > 0 and r["predicted_tokens_per_s"] > 0 for r in runs.values())
        assert v["race"]["a"] == 0.9 and v["race"]["speedup"] > 0 and v["race"]["plain_alone_after_tokens_per_s"] > 0
        for n, tree in v["trees"].items():  # 1 + 3 tokens a round for 5 draft forwards and a pass of n + 1
            cost = v["pass_cost_vs_step"][n + 1]
            assert tree["predicted_speedup"] == pytest.approx(4 / (5 * v["draft_cost_c"] + cost))
    assert report["local_dir_check"]["greedy_identical"] and report["local_dir_check"]["sampled_tokens"] == 40
    assert json.loads((tmp_path / "gpu.json").read_text())["variants"][1]["graphs"] == "eager"


@pytest.mark.slow  # a comparison of whole bench runs; test_bench_writes_json_and_table is the fast tier's
def test_bench_compares_chains_and_trees_in_one_run(tmp_path, capsys):
    report = bench.main(["--pair", "tiny", "--max-new-tokens", "16", "--limit", "2", "--json", str(tmp_path / "t.json"),
                         "--dtype", "float32", "--device", "cpu", "--tree", "0,6"])
    chain, tree = report["variants"]["off, chain"], report["variants"]["off, tree of 6"]
    assert chain["settings"]["tree_nodes"] == 0 and tree["settings"]["tree_nodes"] == 6
    # the costs that sized the chains and the trees, reported: the tiny pair's nominal ones (timing:
    # test_tree_costs_are_timed_once_per_pair)
    assert chain["pass_costs"] == tree["pass_costs"] == dataclasses.asdict(NOMINAL_COSTS)
    for run in (chain, tree):
        assert all(e["identical_to_ar"] for e in run["prompts"])
        assert {"accepted_per_pass_mean", "drafted_per_round_mean", "depth_per_round_mean"} <= set(run["summary"])
    assert all(e["spec"]["drafted_per_round"] <= 6 for e in tree["prompts"])
    assert (tmp_path / "t-off-tree-of-6.html").exists()
    assert "accepted/pass" in capsys.readouterr().out


@pytest.mark.slow  # a comparison of whole bench runs; test_bench_writes_json_and_table is the fast tier's
def test_bench_compares_guesses_in_one_run(tmp_path):
    report = bench.main(["--pair", "tiny", "--max-new-tokens", "16", "--limit", "1", "--json", str(tmp_path / "g.json"),
                         "--dtype", "float32", "--device", "cpu", "--guess", "0,3"])
    assert {name: run["settings"]["guess"] for name, run in report["variants"].items()} == {
        "off, guess 0": 0, "off, guess 3": 3}
    assert all(e["identical_to_ar"] for run in report["variants"].values() for e in run["prompts"])
    for name, run in report["variants"].items():  # a chain without guesses takes a forward for each token it drafts
        for e in run["prompts"]:
            steps, drafted = e["spec"]["draft_steps_per_round"], e["spec"]["drafted_per_round"]
            assert steps == pytest.approx(drafted) if name.endswith("guess 0") else 0 < steps <= drafted


@pytest.mark.slow  # a comparison of whole bench runs; test_bench_writes_json_and_table is the fast tier's
def test_bench_compares_targets_in_one_run(tmp_path):
    report = bench.main(["--pair", "tiny", "--max-new-tokens", "16", "--limit", "1", "--json", str(tmp_path / "k.json"),
                         "--dtype", "float32", "--device", "cpu", "--target-quant", "off,int8"])
    weights = {name: run["target_weights"] for name, run in report["variants"].items()}
    assert weights == {"off": "float32", "int8": "int8"}
    assert report["variants"]["int8"]["cpu_kernels"]["target_int8"] == ("vnni" if int8_vnni.library()[0] else "fbgemm")
    assert all(e["identical_to_ar"] for run in report["variants"].values() for e in run["prompts"])


def test_transformers_constant_k_really_drafts_k_tokens(tiny):
    pair, cfg = with_eos(tiny, []), SpecConfig(max_new_tokens=20)
    ids = encode_request(pair, "hello there", cfg)
    before = pair.draft.generation_config.to_dict()
    scored, forward = [], pair.target.forward
    pair.target.forward = lambda *a, **kw: scored.append(kw["input_ids"].shape[1]) or forward(*a, **kw)
    try:
        peer.hf_assisted(pair, ids, cfg, constant_k=3)
        constant, scored[:] = scored[1:], []  # without the prompt pass
        peer.hf_assisted(pair, ids, cfg)
    finally:
        del pair.target.forward
    assert len(constant) > 3 and set(constant[:-2]) == {4} and max(constant) == 4  # k drafts + 1; the end is cut short
    assert scored[1:] != constant  # the default stops where the draft is unsure (here after one token)
    assert pair.draft.generation_config.to_dict() == before


def test_bench_times_contexts_and_the_draft_step(tmp_path, capsys):
    report = bench.main(["--pair", "tiny", "--max-new-tokens", "8", "--limit", "1", "--json", str(tmp_path / "c.json"),
                         "--dtype", "float32", "--device", "cpu", "--contexts", "32,200", "--draft-table"])
    costs = report["costs_by_context"]
    assert list(costs) == [32, 200] and all(c["step_ms"] > 0 and c["pass_17_ms"] > 0 for c in costs.values())
    assert all(c["prompt_ms"] > 0 and c["draft_prompt_ms"] > 0 for c in costs.values())
    parts = report["draft_step"]["parts"]
    assert set(parts) == {"attention", "mlp", "norms", "head", "sampling", "python and dispatch"}
    assert all(parts[name]["ms"] > 0 for name in ("attention", "mlp", "norms", "head", "sampling"))  # each one timed
    # the parts are the draft's weights, each counted once: against the model's own parameters, counted apart
    from specdec_core.models.tiny import tiny_models

    _, draft, _ = tiny_models()
    weights = sum(p.numel() for p in draft.parameters()) - draft.get_input_embeddings().weight.numel()
    assert sum(parts[n]["mb"] for n in ("attention", "mlp", "norms", "head")) == pytest.approx(weights * 4 / 1e6)
    # and their times shares of one step, none counted twice (a module inside another would be): the rest is measured,
    # not floored at zero
    timed = sum(parts[n]["ms"] for n in ("attention", "mlp", "norms", "head"))
    assert timed < report["draft_step"]["step_ms"]
    assert parts["python and dispatch"]["ms"] == pytest.approx(report["draft_step"]["step_ms"] - timed)
    out = capsys.readouterr().out
    assert "context 200: step_ms" in out and "prompt_ms" in out and "python and dispatch" in out


def test_contexts_are_timed_in_turn(tiny, monkeypatch):
    """Each repetition times every context and size once: a slow spell of the machine cannot fall on one context
    only (timed one after the other, a 17-token pass at 1,000 tokens of context came out at 0.76x to 1.60x the
    same pass at 128)."""
    from specdec_core.cache import CachedModel
    from specdec_core.timing import contexts_ms

    seen, forward = [], CachedModel.forward
    monkeypatch.setattr(CachedModel, "forward", lambda self, ids, keep, **kw: seen.append(
        (self.length + 1, ids.numel(), kw.get("prompt", False))) or forward(self, ids, keep, **kw))
    ms = contexts_ms(tiny, "target", (32, 200), (1, 17), reps=2, warm=1)
    assert [(context, n) for context, n, prompt in seen if not prompt] == [(32, 1), (32, 17), (200, 1), (200, 17)] * 3
    assert list(ms) == [32, 200] and all(list(c) == [1, 17] and min(c.values()) > 0 for c in ms.values())


class FakeLlama:
    """llama_cpp.Llama's generate as the peer uses it: an endless greedy stream."""

    def __init__(self, stream):
        self.stream, self.resets = stream, 0

    def reset(self):
        self.resets += 1

    def generate(self, tokens, reset=True, **sampling):
        assert tokens and sampling["temp"] == 0.0
        yield from self.stream


def test_the_peer_decodes_exactly_our_token_count_past_its_eos_with_the_prompt_timed_apart(monkeypatch):
    """Like for like: the peer writes as many tokens as we did (its end of sequence does not stop it), and its first
    token (the prompt's pass) is timed apart from its decoding."""
    from specdec_core.bench.peer import LlamaCppPeer, agreeing

    peer = LlamaCppPeer([9], model=FakeLlama([5, 6, 7, 9, 4, 4]))
    run = peer.generate([1, 2], SpecConfig(max_new_tokens=10), tokens=5)
    assert run["token_ids"] == [5, 6, 7, 9, 4] and run["tokens"] == 5
    assert 0 < run["prompt_s"] < run["seconds"] and run["decode_tokens_per_s"] == 4 / (run["seconds"] - run["prompt_s"])
    assert peer.generate([1, 2], SpecConfig(max_new_tokens=2), tokens=2)["token_ids"] == [5, 6] and peer.model.resets == 2
    assert agreeing([5, 6, 7, 9], [5, 6, 8, 9]) == 2 and agreeing([5], [5, 6]) == 1
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)  # not installed: a clear message
    with pytest.raises(RuntimeError, match="pip install llama-cpp-python"):
        LlamaCppPeer([9])
    with pytest.raises(SystemExit, match="--pair bundled"):
        bench.main(["--pair", "tiny", "--peer", "llama.cpp"])


@pytest.mark.slow  # starts the app in a child process
def test_startup_bench_times_a_start_until_ready(tmp_path):
    from specdec_core.bench.startup import start

    run = start(tmp_path, limit_s=300, pair="tiny")
    assert run["status"].startswith("Ready:") and 0 < run["seconds"] < 300 and run["resident_mb"] > 50


@pytest.mark.slow  # a whole bench run; test_bench_writes_json_and_table is the fast tier's
def test_bench_times_the_written_draft_step_part_by_part(tmp_path, monkeypatch):
    """The tiny pair with an int4 draft, so that it gets the written-out step: its table names the written step's
    parts (the general forward's are test_bench_times_contexts_and_the_draft_step's)."""
    loaded = bench.load_pair

    def with_int4_draft(*args, **kwargs):
        pair = loaded(*args, **kwargs)
        draft = draft_to_int4(copy.deepcopy(pair.draft).to(torch.bfloat16))
        return dataclasses.replace(pair, draft=draft, written={"draft": DraftStep(draft)})
    monkeypatch.setattr(bench, "load_pair", with_int4_draft)
    report = bench.main(["--pair", "tiny", "--max-new-tokens", "8", "--limit", "1", "--json", str(tmp_path / "s.json"),
                         "--dtype", "float32", "--device", "cpu", "--draft-table"])
    parts = report["draft_step"]["parts"]
    assert set(parts) == {"int4 projections", "head", "sampling", "attention, norms, rotation, cache and Python"}
    assert parts["int4 projections"]["mb"] > 0
    assert all(e["identical_to_ar"] for e in report["prompts"])


def test_the_draft_tables_head_is_timed_after_the_layers_products_as_a_step_runs_it(monkeypatch):
    """Timed alone, call after call, the head's weights stay partly cached and it reads faster than in a step: each
    timed head call comes right after every layer's products, as in a step."""
    from specdec_core.bench import costs
    from specdec_core.models.tiny import tiny_models

    draft = draft_to_int4(tiny_models(seed=0)[0].to(torch.bfloat16))
    step, calls = DraftStep(draft), []
    product = costs.Int4Product.__call__
    monkeypatch.setattr(costs.Int4Product, "__call__", lambda self, x: calls.append("p") or product(self, x))
    draft.get_output_embeddings().register_forward_pre_hook(lambda *a: calls.append("h"))
    table = costs.written_step_table(step, draft, reps=5)
    assert table["head"]["ms"] > 0 and calls.count("h") == 5 + 3
    before_each = "".join(calls).split("h")[:-1]  # the calls before each head call
    assert all(run.count("p") >= 4 * len(step.layers) for run in before_each)  # every layer's four products


def test_the_draft_table_times_the_head_without_the_rare_ids_after_the_layers_products_too(monkeypatch):
    """Where a race's steps leave ids out of the head (drafters.rare_tokens), the table times that head as well, each
    call after every layer's products, and counts the bytes of its rows alone."""
    from specdec_core.bench import costs
    from specdec_core.models.quant import Int4Linear

    from .test_drafters import int4_head_pair
    draft = int4_head_pair().draft
    step, calls = DraftStep(draft), []
    product, without = costs.Int4Product.__call__, Int4Linear.without
    monkeypatch.setattr(costs.Int4Product, "__call__", lambda self, x: calls.append("p") or product(self, x))
    monkeypatch.setattr(Int4Linear, "without", lambda self, x, skip: calls.append("w") or without(self, x, skip))
    table = costs.written_step_table(step, draft, reps=5, rare=(8, 12))
    rare = table["head, rare ids left out"]
    assert rare["ms"] > 0 and rare["mb"] == pytest.approx(table["head"]["mb"] * 0.75) and calls.count("w") == 5 + 3
    assert all(run.count("p") >= 4 * len(step.layers) for run in "".join(calls).split("w")[:-1])
    assert "head, rare ids left out" not in costs.written_step_table(step, draft, reps=2)


def test_startup_bench_times_the_check_of_each_cached_file(tmp_path):
    """The digest check a start makes of the weights it runs from, timed as the startup bench shows it."""
    from specdec_core.bench.startup import checks
    from specdec_core.models.quant import file_digest

    made = tmp_path / "target-int8.safetensors"
    made.write_bytes(b"x" * 3_000_000)
    made.with_name(made.name + ".sha256").write_text(file_digest(made))
    (tmp_path / "draft-int4.safetensors").write_bytes(b"y")
    (tmp_path / "draft-int4.safetensors.sha256").write_text("0" * 64)  # damaged: a start would make it again
    kernel = tmp_path / "kernels" / "int4_vnni-88127b1ee68abbb2.so"  # a built kernel's digest replaces its suffix
    kernel.parent.mkdir()
    kernel.write_bytes(b"\x7fELF")
    kernel.with_suffix(".sha256").write_text(file_digest(kernel))
    timed = checks(tmp_path)
    assert set(timed) == {"target-int8.safetensors", "draft-int4.safetensors", kernel.name}
    assert timed[kernel.name]["same"]
    assert timed["target-int8.safetensors"]["same"] and not timed["draft-int4.safetensors"]["same"]
    assert timed["target-int8.safetensors"]["mb"] == 3.0 and timed["target-int8.safetensors"]["seconds"] > 0


@pytest.mark.slow  # timings of passes at a context and of a draft step: 10 s
def test_a_pair_shared_by_several_variants_has_its_costs_timed_once(tmp_path, monkeypatch):
    """Trees of two sizes run on one loaded pair: its costs by context and its draft table are one measurement (tens
    of seconds on the bundled pair), shared by both variants, not made again for each."""
    calls = []
    for name in ("costs_by_context", "draft_step_table"):
        real = getattr(bench, name)
        monkeypatch.setattr(bench, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    report = bench.main(["--pair", "tiny", "--max-new-tokens", "8", "--limit", "1", "--json", str(tmp_path / "c.json"),
                         "--dtype", "float32", "--device", "cpu", "--tree", "0,6", "--contexts", "16", "--draft-table"])
    assert sorted(calls) == ["costs_by_context", "draft_step_table"]
    chain, tree = report["variants"].values()
    assert chain["costs_by_context"] == tree["costs_by_context"] and chain["costs_by_context"]


def test_the_7b_bench_writes_a_q4_k_m_file_and_measures_a_pair_of_gguf_files(tmp_path):
    """bench.cpu7b on a small shape: the file is llama.cpp's Q4_K_M layout (Q6_K where it gives more bits), loads as a
    user's GGUF pair does, and every simulated run drafts the K its measured costs pick."""
    import argparse

    from specdec_core.bench import cpu7b
    from specdec_core.models.gguf_file import GGUF

    from .models.test_gguf_model import write_gguf
    from .models.test_gguf_pairs import random_model

    tokenizer = write_gguf(random_model("qwen2", 1), tmp_path / "tokenizer.gguf")[0]
    shape = dict(hidden=256, intermediate=512, layers=3, heads=4, kv_heads=2)
    path = cpu7b.write_random(tmp_path / "random.gguf", shape, tokenizer)
    six = sorted(name for name, (kind, *_) in GGUF(path).tensors.items() if kind == 14)
    assert six == ["blk.2.attn_v.weight", "blk.2.ffn_down.weight", "output.weight"]  # layer 2 of 3: more bits
    assert cpu7b.write_random(path, shape, tokenizer) == path  # kept: written once
    pair = dataclasses.replace(load_pair(str(path), str(path), device="cpu", cache_dir=tmp_path), eos_ids=frozenset())
    report = cpu7b.measure(pair, argparse.Namespace(context=16, max_new_tokens=8), {"a=0.8": 0.8, "a=0.3": 0.3})
    assert report["greedy_identical"] and report["plain_tokens"] == 8 and report["draft_cost_c"] > 0
    for run in report["simulated"].values():
        assert run["k"] == cpu7b.best_k(run["a"], report["draft_cost_c"], report["pass_cost_vs_step"])[0]
        assert 1 <= run["k"] <= 8 and run["tokens_per_s"] > 0
