"""Pairs of GGUF files a user names: tiny Qwen2 and Llama models written here as llama.cpp writes its files (every
type a Q4_K_M, Q5_K_M, Q6_K or Q8_0 file holds, a tokenizer in the metadata), named by path, by a split file's first
part, by an Ollama model folder and by a Hub repository's quant with the Hub offline."""
import dataclasses
import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specdec_core import SpecConfig, generate, load_pair
from specdec_core.messages import Refusal
from specdec_core.models import gguf_file, gguf_model, gguf_pair, sources
from specdec_core.models.kernels import kquant
from specdec_core.models.tiny import NOMINAL_COSTS

from .test_gguf_model import GGUF_NAMES, Q4_K_M, TOKENS, encoded, needs_kernel, write_gguf
from .test_int8 import logits_alone_and_in_a_pass

CPU = torch.device("cpu")


def random_model(arch: str, seed: int, layers: int = 2):
    torch.manual_seed(seed)
    shape = dict(vocab_size=len(TOKENS), hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1, tie_word_embeddings=False,
                 max_position_embeddings=4096, rms_norm_eps=1e-6, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    config, model = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    model = model(config(**shape)).eval()
    with torch.no_grad():  # confident, as a trained model mostly is: a draft like it guesses well
        model.lm_head.weight.mul_(10)
    return model


def file_values(model):
    """A copy of the model holding the values its file holds (each weight through its type, in PyTorch's order:
    the types are made row by row, so llama.cpp's order of rows makes the same values)."""
    import copy

    kinds = {**{k: T.Q4_K for k in gguf_model.HF_NAMES}, **Q4_K_M}
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in copied.named_modules():
            if isinstance(module, torch.nn.Linear) or name.endswith("embed_tokens"):
                part = "output" if name == "lm_head" else "token_embd" if name.endswith("embed_tokens") else \
                    GGUF_NAMES[".".join(name.split(".")[3:])]
                data, kind = encoded(module.weight.float(), kinds.get(part, T.Q4_K))
                module.weight.copy_(torch.from_numpy(quants.dequantize(data, kind)))
    return copied


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """{name: path}: Qwen2 and Llama targets and drafts (the draft a perturbed copy of its target, so that it
    guesses well), a draft of another vocabulary, and a Llama target in two files."""
    root = tmp_path_factory.mktemp("pairs")
    out = {}
    for arch in ("qwen2", "llama"):
        target = random_model(arch, 1)
        draft = random_model(arch, 1)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(torch.randn_like(p) * 0.003)
        out[f"{arch}-target"], out[f"{arch}-draft"] = root / f"{arch}-target.gguf", root / f"{arch}-draft.gguf"
        write_gguf(target, out[f"{arch}-target"])
        write_gguf(draft, out[f"{arch}-draft"])
        out[f"{arch}-model"] = target
    out["other-vocab"] = root / "other-vocab.gguf"
    write_gguf(random_model("qwen2", 2), out["other-vocab"], tokens=TOKENS[:-2] + ["xy", "<|end|>"])
    out["split"] = write_gguf(out["llama-model"], root / "split.gguf", shards=3)[0]
    return out


def greedy_same(pair, prompt: str = "the cat is in there", n: int = 24) -> list[int]:
    pair = dataclasses.replace(pair, pass_costs=NOMINAL_COSTS, eos_ids=frozenset())
    cfg = SpecConfig(k=4, max_new_tokens=n)
    spec, plain = generate(pair, prompt, cfg), generate(pair, prompt, cfg, "autoregressive")
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted > 0  # the draft's guesses were taken: its rounds ran
    return spec.token_ids


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_pair_named_by_its_files_decodes_exactly_what_plain_decoding_does(made, arch, tmp_path):
    needs_kernel()
    pair = load_pair(str(made[f"{arch}-target"]), str(made[f"{arch}-draft"]), device="cpu", cache_dir=tmp_path)
    assert pair.info.target_quant == "blocks" and pair.info.target == f"{arch}-target.gguf"
    assert pair.name == f"{arch}-target.gguf <- {arch}-draft.gguf"  # what visitors and traces see: no server path
    assert {m.kind for m in pair.target.modules() if isinstance(m, kquant.KQuantLinear)} == {4, 6}
    assert pair.tokenizer.decode(pair.tokenizer("the cat is in there").input_ids) == "the cat is in there"
    greedy_same(pair)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_target_computes_the_models_own_function(made, arch):
    """Against PyTorch's model of the values written (Llama's query and key rows back in its order): int8 activations,
    so close, not equal. A Llama read without undoing llama.cpp's row order computes another function."""
    needs_kernel()
    model = file_values(made[f"{arch}-model"])
    ids = torch.tensor([[1, 5, 9, 200, 17, 4, 90, 33]])
    with torch.inference_mode():
        want = model(ids).logits
        got = gguf_model.load_target(made[f"{arch}-target"])(ids).logits
    assert ((got - want).norm() / want.norm()).item() < 0.06
    if arch == "llama":
        f = gguf_file.GGUF(made["llama-target"])
        f.rotated_heads = lambda name: 0
        with torch.inference_mode():
            unordered = gguf_model.load_target(f)(ids).logits
        assert ((unordered - want).norm() / want.norm()).item() > 0.2


COMPUTED_AS = {T.Q4_0: 8, T.Q5_0: 8, T.Q8_0: 8, T.Q5_K: 5, T.Q6_K: 6, T.F16: 8, T.BF16: 8, T.F32: 8}


@pytest.mark.parametrize("kind", list(COMPUTED_AS))
def test_every_type_such_files_hold_loads_exact_in_steps_and_passes(kind, tmp_path):
    """A Llama target and draft whose projections are all of `kind`: the values read are the file's (against gguf's
    own dequantisation); the target computes on the file's blocks (Q4_0 and Q5_0 as the same values in Q8_0; float
    weights rounded to Q8_0), and gives a position the same logits bits in a step and in any pass."""
    needs_kernel()
    model = random_model("llama", 3, layers=1)
    kinds = {p: kind for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output")}
    path = write_gguf(model, tmp_path / "m.gguf", kinds)[0]
    f = gguf_file.GGUF(path)
    raw, file_kind, n, k = f.raw("blk.0.ffn_up.weight")
    values = torch.from_numpy(quants.dequantize(raw.numpy().reshape(n, -1), kind).astype(np.float32))
    assert file_kind == kind and torch.equal(f.dense("blk.0.ffn_up.weight"), values)
    blocks, computed, _, _ = gguf_model.blocks_of(f, "blk.0.ffn_up.weight")
    assert computed == COMPUTED_AS[kind]
    if kind in (T.Q4_0, T.Q5_0):  # moved, not rounded
        assert torch.equal(torch.from_numpy(quants.dequantize(blocks.numpy().reshape(n, -1), T.Q8_0)), values)
    pair = load_pair(str(path), str(path), device="cpu", cache_dir=tmp_path)
    assert {m.kind for m in pair.target.modules() if isinstance(m, kquant.KQuantLinear)} >= {COMPUTED_AS[kind]}
    for written in (None, pair.written["target"]):  # as loaded, and its forwards written out (step.py)
        alone, full, tree, branch_alone = logits_alone_and_in_a_pass(pair.target, pair.vocab, written=written)
        assert torch.equal(alone, full) and torch.equal(tree, branch_alone)
    greedy_same(pair)


def test_a_model_split_by_gguf_split_is_read_from_its_first_part(made, tmp_path):
    needs_kernel()
    first = made["split"]
    assert first.name == "split-00001-of-00003.gguf"
    assert [p.name for p in sources.shards_of(first)] == ["split-00002-of-00003.gguf", "split-00003-of-00003.gguf"]
    ids = torch.tensor([[1, 5, 9, 200]])
    with torch.inference_mode():
        whole = gguf_model.load_target(made["llama-target"])(ids).logits
        split = gguf_model.load_target(gguf_file.GGUF(first, sources.shards_of(first)))(ids).logits
    assert torch.equal(whole, split)
    with pytest.raises(Refusal, match="later part"):
        sources.gguf_files(str(first.with_name("split-00002-of-00003.gguf")))
    with pytest.raises(ValueError, match="one of 3 files, read with 1"):
        gguf_file.GGUF(first)
    greedy_same(load_pair(str(first), str(made["llama-draft"]), device="cpu", cache_dir=tmp_path))


def test_a_draft_of_another_vocabulary_is_refused_by_name_before_loading(made, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_pair, "load_target", lambda f: pytest.fail("the target was loaded"))
    with pytest.raises(Refusal, match="different tokenizers") as err:
        load_pair(str(made["qwen2-target"]), str(made["other-vocab"]), device="cpu", cache_dir=tmp_path)
    assert "other-vocab.gguf" in str(err.value) and "qwen2-target.gguf" in str(err.value)


def ollama_folder(root, name: str, tag: str, blob_of) -> None:
    """Ollama's layout: a manifest per name and tag, each layer a blob named by its digest."""
    layers = []
    for media, data in (("application/vnd.ollama.image.template", b"{{ .Prompt }}"),
                        ("application/vnd.ollama.image.model", blob_of.read_bytes())):
        import hashlib
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        (root / "blobs" / digest.replace(":", "-")).write_bytes(data)
        layers.append({"mediaType": media, "digest": digest, "size": len(data)})
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))


def test_ollama_models_are_read_from_their_blobs(made, tmp_path, monkeypatch):
    needs_kernel()
    root = tmp_path / "ollama"
    ollama_folder(root, "tiny-qwen", "latest", made["qwen2-target"])
    ollama_folder(root, "tiny-qwen", "draft", made["qwen2-draft"])
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    assert sources.gguf_files("ollama:tiny-qwen")[0].read_bytes() == made["qwen2-target"].read_bytes()
    pair = load_pair("ollama:tiny-qwen", "ollama:tiny-qwen:draft", device="cpu", cache_dir=tmp_path / "cache")
    assert pair.info.target == "ollama:tiny-qwen"
    greedy_same(pair)
    for name, said in (("ollama:nothing", "Ollama has no model nothing"), ("ollama:../x", "not an Ollama model name"),
                       ("ollama:a/b/c/d", "not an Ollama model name")):
        with pytest.raises(Refusal, match=said):
            sources.gguf_files(name)
    (root / "manifests" / "registry.ollama.ai" / "library" / "tiny-qwen" / "broken").write_text('{"layers": 3}')
    with pytest.raises(Refusal, match="names no model file"):
        sources.gguf_files("ollama:tiny-qwen:broken")


def test_a_hub_repositorys_quant_is_read_from_the_hubs_cache_offline(made, tmp_path, monkeypatch):
    """A cache laid out as huggingface_hub lays it out, with the Hub offline: the quant is picked by its name."""
    needs_kernel()
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny-GGUF"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for quant, source in (("Q4_K_M", "qwen2-target"), ("Q8_0", "qwen2-draft")):
        (snapshot / f"tiny-{quant}.gguf").write_bytes(made[source].read_bytes())
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert sources.gguf_files("someone/tiny-GGUF:q4_k_m")[0].name == "tiny-Q4_K_M.gguf"
    pair = load_pair("someone/tiny-GGUF:q4_k_m", "someone/tiny-GGUF:Q8_0", device="cpu", cache_dir=tmp_path / "c")
    greedy_same(pair)
    with pytest.raises(Refusal, match="no GGUF file of quantisation q5_k_m"):
        sources.gguf_files("someone/tiny-GGUF:q5_k_m")
    with pytest.raises(Refusal, match="cache holds no GGUF files of someone/else"):
        sources.gguf_files("someone/else:q4_k_m")


def test_a_quant_is_one_model_or_refused():
    files = ["a-Q4_K_M.gguf", "a-Q4_K_S.gguf", "b/x-q8_0-00001-of-00002.gguf", "b/x-q8_0-00002-of-00002.gguf", "README.md"]
    assert sources.pick_quant(files, "r", "q4_k_m") == ["a-Q4_K_M.gguf"]
    assert sources.pick_quant(files, "r", "Q8_0") == files[2:4]
    with pytest.raises(Refusal, match="more than one model"):
        sources.pick_quant(files + ["c-Q8_0.gguf"], "r", "q8_0")
    assert sources.is_gguf("Qwen/Qwen2.5-7B-Instruct-GGUF:q4_k_m") and not sources.is_gguf("Qwen/Qwen2.5-7B-Instruct")
    assert sources.is_local("ollama:qwen2.5:7b") and sources.is_local("/m/x.gguf") and not sources.is_local("a/b:q8_0")


def test_what_is_not_a_model_is_refused_with_its_name(made, tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    (tmp_path / "text.gguf").write_text("hello")
    for name, said in ((tmp_path / "junk.gguf", "junk.gguf cannot be read as a model"),
                       (tmp_path / "text.gguf", "text.gguf cannot be read as a model"),
                       (tmp_path / "none.gguf", "No GGUF file at")):
        with pytest.raises(Refusal, match=said):
            load_pair(str(name), str(made["qwen2-draft"]), device="cpu", cache_dir=tmp_path)
    with pytest.raises(Refusal, match="needs a GGUF draft"):
        load_pair(str(made["qwen2-target"]), "Qwen/Qwen2.5-0.5B-Instruct", device="cpu", cache_dir=tmp_path)
    with pytest.raises(Refusal, match="this server loads pairs up to 0 GB"):
        load_pair(str(made["qwen2-target"]), str(made["qwen2-draft"]), device="cpu", cache_dir=tmp_path, budget_gb=1e-4)


def test_where_the_blocks_product_cannot_run_a_named_pair_is_exact_in_int8(made, tmp_path):
    """The way a CPU without AVX-512 VNNI (or without a compiler) runs a GGUF target: int8 weights from its values."""
    pair = load_pair(str(made["llama-target"]), str(made["llama-draft"]), device="cpu", cache_dir=tmp_path,
                     target_quant="int8")
    assert pair.info.target_weights == "int8" and not any(isinstance(m, kquant.KQuantLinear) for m in pair.target.modules())
    greedy_same(pair)
