"""Loading pairs from local directories (the same code path as hub ids) and pair invariants."""
import dataclasses

import pytest
import torch
from transformers import Qwen2ForCausalLM

from specdec_core import SpecConfig, generate, load_pair
from specdec_core.models import pick_device, pick_dtype
from specdec_core.models.tiny import NOMINAL_COSTS, tiny_config, tiny_models, tiny_tokenizer

from ...conftest import with_eos


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target, draft, tok = tiny_models()
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    # a target whose vocab rows are padded past the tokenizer, like Qwen2.5-7B (152,064 rows vs 151,936)
    torch.manual_seed(5)
    padded = Qwen2ForCausalLM(tiny_config(len(tok) + 7))
    padded.save_pretrained(root / "padded")
    tok.save_pretrained(root / "padded")
    # a target whose layers take 256 inputs: on Q8_0 blocks by default where the blocks' fast product runs
    torch.manual_seed(6)
    wide = Qwen2ForCausalLM(tiny_config(len(tok) + 13, hidden=256))  # 272 rows: outputs of 16
    wide.save_pretrained(root / "wide")
    tok.save_pretrained(root / "wide")
    # a draft with a different tokenizer
    other = tiny_tokenizer()
    other.add_tokens(["<extra>"])
    draft.save_pretrained(root / "other")
    other.save_pretrained(root / "other")
    return root


def test_local_directories_load_and_decode_losslessly(model_dirs):
    pair = load_pair(str(model_dirs / "target"), str(model_dirs / "draft"), device="cpu", dtype="float32")
    assert pair.vocab == len(pair.tokenizer) and pair.draft is not None
    assert pair.info.draft_quant == "int8"  # int4 is for bfloat16 only
    cfg = SpecConfig(k=4, max_new_tokens=24)
    pair = with_eos(pair, [])
    assert generate(pair, "hello", cfg).token_ids == generate(pair, "hello", cfg, "autoregressive").token_ids


def test_a_hub_target_computes_on_q8_0_blocks_made_from_its_values_exactly(model_dirs, monkeypatch):
    """The arithmetic of a GGUF target: a position's logits the same bits in a step and in any pass, greedy output
    plain decoding's; a target of other shapes falls back to int8 by default, and is refused by name when blocks are
    asked for."""
    from app.pairs import Weights
    from specdec_core.models import load
    from specdec_core.models.kernels import kquant

    from .test_gguf_model import needs_kernel
    from .test_int8 import logits_alone_and_in_a_pass

    needs_kernel()
    monkeypatch.setattr(load, "kquant_library", lambda: (kquant.kernel(), "avx512-vnni"))  # what auto reads
    pair = with_eos(load_pair(str(model_dirs / "wide"), str(model_dirs / "draft"), device="cpu", dtype="float32"), [])
    assert pair.info.target_quant == "blocks" and pair.info.target_weights.startswith("q8_0:")
    assert "Q8_0 blocks made from its values" in Weights(pair.info.target_weights, False).text("en")
    assert {m.kind for m in pair.target.modules() if isinstance(m, kquant.KQuantLinear)} == {8}
    for written in (None, pair.written["target"]):
        alone, full, tree, branch_alone = logits_alone_and_in_a_pass(pair.target, pair.vocab, written=written)
        assert torch.equal(alone, full) and torch.equal(tree, branch_alone)
    cfg = SpecConfig(k=4, max_new_tokens=24)
    assert generate(pair, "hello", cfg).token_ids == generate(pair, "hello", cfg, "autoregressive").token_ids
    narrow = load_pair(str(model_dirs / "target"), str(model_dirs / "draft"), device="cpu", dtype="float32")
    assert narrow.info.target_quant == "int8"
    with pytest.raises(ValueError, match="multiple of 256 inputs"):
        load_pair(str(model_dirs / "target"), str(model_dirs / "draft"), device="cpu", dtype="float32",
                  target_quant="blocks")


def test_padded_vocab_rows_are_cut_to_the_shared_range(model_dirs):
    pair = with_eos(load_pair(str(model_dirs / "padded"), str(model_dirs / "draft"), device="cpu", dtype="float32"), [])
    assert pair.target.get_output_embeddings().out_features == pair.vocab + 7  # (the exact int8 target on a CPU)
    out = generate(pair, "hello", SpecConfig(k=3, max_new_tokens=20, temperature=1.0))
    assert all(t < pair.vocab for t in out.token_ids)
    cfg = SpecConfig(k=3, max_new_tokens=20)
    assert generate(pair, "hello", cfg).token_ids == generate(pair, "hello", cfg, "autoregressive").token_ids


def test_different_tokenizers_are_refused_naming_both(model_dirs):
    with pytest.raises(ValueError, match="different tokenizers") as err:
        load_pair(str(model_dirs / "target"), str(model_dirs / "other"), device="cpu", dtype="float32")
    assert "target" in str(err.value) and "other" in str(err.value)


def test_custom_pair_needs_a_draft():
    with pytest.raises(ValueError, match="draft"):
        load_pair("some/model")


def test_device_and_dtype_choice():
    assert pick_device("cpu").type == "cpu"
    assert pick_dtype("float32", torch.device("cpu")) == torch.float32
    assert pick_dtype("auto", torch.device("cpu")) in (torch.bfloat16, torch.float32)
    with pytest.raises(ValueError):
        pick_dtype("int3", torch.device("cpu"))


def test_tiny_pair_loads():
    pair = load_pair("tiny", device="cpu", dtype="float32")
    assert pair.name == "tiny" and pair.vocab == 259 and pair.eos_ids == {258}


def test_a_loaded_pair_is_finished_nothing_is_assigned_to_it_after():
    """load_pair returns the pair whole: what it says of itself, and its costs (the tiny pair's nominal ones, which a
    race of it drafts by on any machine; a pair's timed ones, once: test_tree's test_tree_costs_are_timed_once_per_pair)."""
    pair = load_pair("tiny", device="cpu", dtype="float32", target_quant="int8")
    assert pair.info.target_weights == "int8" and pair.info.target_quant == "int8"  # said while it was built
    for obj, name in ((pair, "pass_costs"), (pair, "context_length"), (pair.info, "graphs")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, None)
    assert pair.costs() is pair.pass_costs is NOMINAL_COSTS and not NOMINAL_COSTS.step_ms  # nothing timed


def test_the_same_model_as_draft_and_target(model_dirs):
    # both as loaded: on CPUs they would otherwise be quantised (the draft int4, the target int8), no longer one model
    pair = with_eos(load_pair(str(model_dirs / "target"), str(model_dirs / "target"), device="cpu", dtype="float32",
                              draft_quant=False, target_quant="off"), [])
    assert pair.info.draft_quant == ""
    plain = generate(pair, "hello", SpecConfig(k=4, max_new_tokens=20), "autoregressive").token_ids
    assert generate(pair, "hello", SpecConfig(k=4, max_new_tokens=20)).token_ids == plain  # at its own costs
    # a draft as dear as the target never pays, so its own costs may give only plain steps: judged free, it drafts
    out = generate(dataclasses.replace(pair, pass_costs=NOMINAL_COSTS), "hello", SpecConfig(k=4, max_new_tokens=20))
    assert out.stats.drafted and out.stats.acceptance_rate == 1.0
    assert out.token_ids == plain


def test_unknown_graphs_mode_is_refused_before_loading():
    with pytest.raises(ValueError, match="graphs must be"):
        load_pair("bundled", graphs="fast")


@pytest.mark.parametrize("option, match", [(dict(graphs="fast"), "graphs must be"), (dict(dtype="int3"), "dtype must be"),
                                           (dict(target_quant="int8:nope"), "target_quant must be"),
                                           (dict(draft_quant="int2"), "draft_quant must be")])
def test_load_options_are_checked_when_made_so_an_app_refuses_them_at_start(option, match):
    from app.pairs import PairManager
    from specdec_core.models import LoadOptions

    with pytest.raises(ValueError, match=match):
        LoadOptions(**option)
    if set(option) <= {"graphs", "dtype", "target_quant"}:
        with pytest.raises(ValueError, match=match):
            PairManager(**option)  # the app's start, before any load
    with pytest.raises(TypeError, match="not both"):
        load_pair("tiny", options=LoadOptions(), dtype="float32")


def test_a_cpu_draft_reads_its_key_value_heads_as_they_are(model_dirs):
    """transformers' SDPA repeats a draft's key/value heads over the cache every step (its cost grows with the
    context); on CPUs the draft runs grouped attention instead. The draft only changes speed: output stays."""
    from specdec_core.models.attention import GROUPED

    pair = with_eos(load_pair(str(model_dirs / "target"), str(model_dirs / "draft"), device="cpu", dtype="float32"), [])
    assert pair.draft.config._attn_implementation == GROUPED
    assert pair.target.config._attn_implementation == "specdec_rows"  # the exact target keeps its own
    cfg = SpecConfig(k=4, max_new_tokens=24)
    assert generate(pair, "grouped", cfg).token_ids == generate(pair, "grouped", cfg, "autoregressive").token_ids


def test_each_dtype_keeps_its_own_quantised_files_of_the_bundled_pair(monkeypatch, tmp_path):
    """The bundled draft quantised from bfloat16 values (int4) and from float32 ones (int8: int4 needs
    bfloat16) are different files, as are int8 targets made from either: one cache serves both without rebuilding
    the other's file at every start (a float32 load used to overwrite the default's 669 MB draft, and the next default
    start made it again)."""
    from specdec_core.models import bundled
    from specdec_core.models.load import LoadOptions, read_models

    monkeypatch.setattr(bundled, "load_bundled", lambda *args, **kw: (None, tmp_path))
    files = {}
    for dt in (torch.bfloat16, torch.float32):
        _, saved = read_models("bundled", None, LoadOptions(), "int8", True, torch.device("cpu"), dt, lambda f, m: None)
        files[dt] = saved
        assert all(path.parent == tmp_path for path, _ in saved.values())
    for role in ("draft", "target"):
        assert files[torch.bfloat16][role][0] != files[torch.float32][role][0], role
    assert files[torch.bfloat16]["draft"][0].name == f"{bundled.DRAFT.slug}-int4-bfloat16.safetensors"
