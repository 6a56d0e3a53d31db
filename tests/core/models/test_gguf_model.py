"""Models read from GGUF files as they are: a tiny Qwen2 written here as llama.cpp writes its files (write_gguf, which
writes test_gguf_pairs' files too), read whole or from parts, exact in steps and passes, lossless in speculative
decoding."""
import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from specdec_core import SpecConfig, generate
from specdec_core.cache import CachedModel, TreeInput
from specdec_core.models import Pair, gguf_file, gguf_model
from specdec_core.models.attention import ROWS
from specdec_core.models.kernels import kquant
from specdec_core.models.step import KQuantProduct, TargetForward
from specdec_core.models.tiny import NOMINAL_COSTS

from .test_int8 import logits_alone_and_in_a_pass

GGUF_NAMES = {v: k for k, v in gguf_model.HF_NAMES.items()}
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("a", "n"), ("e", "r"), ("o", "n"), ("Ġ", "a"), ("r", "e"),
          ("a", "t"), ("o", "r"), ("e", "n"), ("Ġ", "s"), ("e", "s"), ("i", "s")]
TOKENS = [bytes_to_unicode()[i] for i in range(256)] + ["".join(m) for m in MERGES] + ["<|end|>"]  # 272
Q4_K_M = {"attn_v": T.Q6_K, "ffn_down": T.Q6_K, "output": T.Q6_K}  # the rest Q4_K, as llama.cpp's Q4_K_M


def needs_kernel():
    if kquant.library()[0] is None:
        pytest.skip(f"the product on GGUF blocks cannot be built here: {kquant.library()[1]}")


def random_model(seed: int, vocab: int = 272) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, initializer_range=0.1, tie_word_embeddings=False, max_position_embeddings=4096,
                      rms_norm_eps=1e-6, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    return Qwen2ForCausalLM(cfg).eval()


def q5_k(w: torch.Tensor) -> np.ndarray:
    """Q5_K blocks holding Q4_K's values: each 4-bit q doubled (5 bits), d halved (exact in float16)."""
    q4 = kquant.quantise(w, 4).reshape(-1, 144).numpy()
    d = (q4[:, :2].copy().view(np.float16) / 2).view(np.uint8)
    nibbles = q4[:, 16:].reshape(-1, 4, 32)  # chunks of 64 values: the low nibbles the first 32, the high the next
    q = np.stack([nibbles & 15, nibbles >> 4], 2) * 2  # [blocks, 4 chunks, 2 halves, 32]
    qs = (q[:, :, 0] & 15 | (q[:, :, 1] & 15) << 4).reshape(-1, 128)
    qh = sum((q[:, j, h] >> 4) << (2 * j + h) for j in range(4) for h in range(2))
    return np.concatenate([d, q4[:, 2:16], qh, qs], 1).astype(np.uint8).reshape(len(w), -1)


def encoded(t: torch.Tensor, kind: T) -> tuple[np.ndarray, T]:
    if kind in (T.Q4_K, T.Q6_K):
        return kquant.quantise(t, 4 if kind == T.Q4_K else 6).numpy(), kind
    if kind == T.Q5_K:
        return q5_k(t), kind
    return quants.quantize(t.numpy(), kind), kind


def llama_cpp_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """A query or key weight in llama.cpp's order: each head's two rotated halves interleaved."""
    return t.reshape(heads, 2, t.shape[0] // heads // 2, -1).transpose(1, 2).reshape(t.shape)


def write_gguf(model, path, kinds: dict | None = None, tokens: list[str] = TOKENS, shards: int = 1) -> list:
    """The model as llama.cpp writes it: `kinds` {GGUF part name: type}, the rest Q4_K; in `shards` files as
    gguf-split cuts them (path's name then ends -00001-of-0000N.gguf)."""
    c, arch = model.config, model.config.model_type
    kinds = Q4_K_M if kinds is None else kinds
    tensors = []
    for name, t in model.state_dict().items():
        t, parts = t.detach().float(), name.split(".")
        if name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            gname = {"model.embed_tokens.weight": "token_embd", "lm_head.weight": "output"}.get(name, "output_norm")
        else:
            gname = f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:-1])]}"
        part = gname.rpartition(".")[2]
        if arch == "llama" and part in ("attn_q", "attn_k"):
            t = llama_cpp_rows(t, c.num_attention_heads if part == "attn_q" else c.num_key_value_heads)
        data = encoded(t, kinds.get(part, T.Q4_K)) if t.dim() == 2 else (t.numpy(), None)
        tensors.append((f"{gname}.{parts[-1]}", *data))
    paths = [path] if shards == 1 else [path.with_name(f"{path.stem}-{i:05d}-of-{shards:05d}.gguf") for i in range(1, shards + 1)]
    per = -(-len(tensors) // shards)
    for i, file in enumerate(paths):
        w = GGUFWriter(file, arch)
        if i == 0:
            for key, value in (("block_count", c.num_hidden_layers), ("context_length", c.max_position_embeddings),
                               ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                               ("attention.head_count", c.num_attention_heads),
                               ("attention.head_count_kv", c.num_key_value_heads)):
                w.add_uint32(f"{arch}.{key}", value)
            w.add_float32(f"{arch}.rope.freq_base", c.rope_parameters["rope_theta"])
            w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
            w.add_tokenizer_model("gpt2")
            w.add_tokenizer_pre("qwen2")
            w.add_token_list(tokens)
            w.add_token_types([1] * (len(tokens) - 1) + [3])
            w.add_token_merges([f"{a} {b}" for a, b in MERGES])
            w.add_eos_token_id(len(tokens) - 1)
        if shards > 1:
            w.add_uint16("split.no", i)
            w.add_uint16("split.count", shards)
            w.add_int32("split.tensors.count", len(tensors))
        for name, data, kind in tensors[i * per: (i + 1) * per]:
            w.add_tensor(name, data, raw_dtype=kind)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return paths


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(the whole file, the same bytes in three parts cut through tensors)."""
    root = tmp_path_factory.mktemp("gguf")
    write_gguf(random_model(0), root / "tiny.gguf")
    data = (root / "tiny.gguf").read_bytes()
    cuts = [0, len(data) // 3 + 7, 2 * len(data) // 3 + 1, len(data)]
    parts = []
    for i in range(3):
        parts.append(root / f"part{i}.bin")
        parts[-1].write_bytes(data[cuts[i]: cuts[i + 1]])
    return root / "tiny.gguf", parts


def test_the_target_on_its_blocks_computes_the_models_values(files):
    """Against the same file's values in float32 (load_dense): the products round activations to int8, so close,
    not equal; and every Linear runs on the file's blocks."""
    needs_kernel()
    exact, dense = gguf_model.load_target(files[0]), gguf_model.load_dense(files[0], torch.float32)
    kinds = [m.kind for m in exact.modules() if isinstance(m, kquant.KQuantLinear)]
    assert kinds.count(6) == 5 and kinds.count(4) == 10  # v and down in 2 layers, and the head; q, k, o, gate, up
    ids = torch.tensor([[1, 5, 9, 200, 17, 4]])
    with torch.inference_mode():
        a, b = exact(ids).logits, dense(ids).logits
    assert ((a - b).norm() / b.norm()).item() < 0.06  # int8 activations, through two random layers
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_a_file_read_from_its_parts_is_the_file(files):
    needs_kernel()
    whole, parts = gguf_file.GGUF(files[0]), gguf_file.GGUF(files[1])
    assert whole.fields == parts.fields and whole.tensors == parts.tensors
    spanning = [n for n, (_, _, offset, size) in parts.tensors.items()
                if np.searchsorted(parts.starts, offset, side="right") != np.searchsorted(parts.starts, offset + size - 1, side="right")]
    assert spanning  # the cuts run through tensors
    for name in spanning:
        assert torch.equal(whole.raw(name)[0], parts.raw(name)[0])
    ids = torch.tensor([[1, 5, 9, 200]])
    with torch.inference_mode():
        assert torch.equal(gguf_model.load_target(files[0])(ids).logits, gguf_model.load_target(files[1])(ids).logits)


def test_a_damaged_file_is_refused_with_its_name(tmp_path, files):
    data = files[0].read_bytes()
    (tmp_path / "short.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="short.gguf is cut short"):
        gguf_file.GGUF(tmp_path / "short.gguf")
    (tmp_path / "other.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="other.gguf is not a GGUF file"):
        gguf_file.GGUF(tmp_path / "other.gguf")


def test_a_steps_projections_are_joined_where_they_were_packed_not_copied(files):
    """load_target packs each run of one kind among q, k, v and gate, up side by side; the step's products take the
    runs where they lie (a copy of them cost the bundled target half a second at every start)."""
    needs_kernel()
    model = gguf_model.load_target(files[1])
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for run, kind in (([a.q_proj, a.k_proj], 4), ([m.gate_proj, m.up_proj], 4)):  # v is Q6_K, a run of its own
            where = [p.packed.data_ptr() for p in run]
            joined = KQuantProduct(run).runs
            assert [(k, packed.data_ptr(), packed.numel()) for k, packed, _, _ in joined] == \
                [(kind, where[0], sum(p.packed.numel() for p in run))]
            assert [p.packed.data_ptr() for p in run] == where


@pytest.fixture(scope="module")
def exact_target(files):
    needs_kernel()
    model = gguf_model.load_target(files[1])
    model.set_attn_implementation(ROWS)
    return model


class Spy:
    """The target's written-out forward (step.py), counting the forwards it took."""

    def __init__(self, model):
        self.forward, self.took = TargetForward(model), 0

    def __call__(self, *args):
        logits = self.forward(*args)
        self.took += logits is not None
        return logits


@pytest.mark.parametrize("context", [57, 300])
def test_the_target_on_its_blocks_gives_a_position_the_same_logits_alone_or_in_a_pass(exact_target, context):
    """Through transformers' forward, and through the written-out one, which takes every forward: the prompt, 17 + 9
    steps, a chain pass and a tree pass."""
    alone, chain, tree, branch_alone = logits_alone_and_in_a_pass(exact_target, 272, context)
    assert torch.equal(alone, chain) and torch.equal(tree, branch_alone)
    assert TargetForward.fits(exact_target)
    spy = Spy(exact_target)
    alone, chain, tree, branch_alone = logits_alone_and_in_a_pass(exact_target, 272, context, spy)
    assert torch.equal(alone, chain) and torch.equal(tree, branch_alone)
    assert spy.took == (1 + context // 256) + 17 + 1 + 1 + 9


def test_the_written_out_target_follows_the_general_forward(exact_target):
    """The same function: float32 both, so they part only where an activation's int8 rounding tips (one tip moves
    this random model's logits by 1-3%); a tree's mask dropped parts them by up to 95%."""
    written, general = CachedModel(exact_target, 272, written=Spy(exact_target)), CachedModel(exact_target, 272)
    prompt = [(7 * i) % 250 + 3 for i in range(300)]  # two chunks
    worst = 0.0
    for lm in (written, general):
        lm.prefill(prompt)
    for ids, tree in ((torch.tensor([5]), None), (torch.arange(20, 29), None), (torch.arange(40, 46), TreeInput([-1, 0, 0, 1, 2, -1]))):
        mine, theirs = written.forward(ids, keep=len(ids), tree=tree), general.forward(ids, keep=len(ids), tree=tree)
        worst = max(worst, ((mine - theirs).norm() / theirs.norm()).item())
    assert worst < 0.1 and written.written.took == 2 + 3


def test_the_forwards_plans_serve_every_cache_and_thread_with_its_own_numbers(exact_target):
    """A TargetForward keeps each size's forward as bound calls over buffers of its own (WrittenForward.plan). Two
    caches that take turns on one forward (the race's two lanes), one of them growing its buffers past their room
    between two steps, and two threads decoding at once, get the logits each would get on a forward of its own; and
    logits handed out stay as they were when later forwards run."""
    import threading

    def decode(step, prompt, steps, ready=None):
        lm = CachedModel(exact_target, 272, written=step)
        lm.prefill(prompt)
        if ready:
            ready.wait()  # both threads decode at once
        return [lm.forward(torch.tensor([(3 * i + prompt[0]) % 250 + 3]), keep=1) for i in range(steps)]

    prompts = ([(7 * i) % 250 + 3 for i in range(250)], [(5 * i) % 250 + 3 for i in range(40)])  # 250 + 12 > 256: grows
    alone = [decode(TargetForward(exact_target), prompt, 60) for prompt in prompts]
    shared = TargetForward(exact_target)
    lanes = [CachedModel(exact_target, 272, written=shared) for _ in prompts]
    for lm, prompt in zip(lanes, prompts):
        lm.prefill(prompt)
    taken, kept = [[], []], None
    for i in range(12):
        for j, (lm, prompt) in enumerate(zip(lanes, prompts)):
            taken[j].append(lm.forward(torch.tensor([(3 * i + prompt[0]) % 250 + 3]), keep=1))
        if i == 0:
            kept = [t[0].clone() for t in taken]
    assert all(torch.equal(a, b) for j in range(2) for a, b in zip(alone[j][:12], taken[j], strict=True))
    assert torch.equal(kept[0], taken[0][0]) and torch.equal(kept[1], taken[1][0])
    assert lanes[0].cache.layers[0].buffers["keys"].shape[2] > 256  # the first lane's buffers grew on the way
    results, ready = [None, None], threading.Barrier(2)

    def worker(j):
        results[j] = decode(shared, prompts[j], 60, ready)
    threads = [threading.Thread(target=worker, args=(j,)) for j in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(a, b) for j in range(2) for a, b in zip(alone[j], results[j], strict=True))


def test_a_plan_that_is_not_kept_is_freed_when_its_forward_ends(exact_target):
    """A prompt's plan (its own mask, its own size) holds buffers for every row: left to the collector's cycles, each
    waited for a collection, and the bench's peak memory on the bundled pair rose from 4.35 to 7.3-8.5 GB."""
    import gc
    import weakref

    step, made = TargetForward(exact_target), []
    plan = step.plan
    step.plan = lambda n, attention: made.append(plan(n, attention)) or made[-1]
    lm = CachedModel(exact_target, 272, written=step)
    gc.disable()
    try:
        lm.prefill(list(range(3, 103)))  # a prompt
        lm.forward(torch.tensor([5]), keep=1)  # a step: its plan kept
        alive = [weakref.ref(p) for p in made]
        made.clear()
        assert [ref() is None for ref in alive] == [True, False]
    finally:
        gc.enable()


def test_a_plan_holds_one_layers_buffers_whatever_the_number_of_layers(exact_target):
    """Every layer writes the same buffers in turn: a prompt's plan of 256 rows holds one layer's outputs (40 MB on the
    bundled target), not every layer's (1 GB)."""
    c = exact_target.config
    d = c.hidden_size // c.num_attention_heads
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * d
    one_layer = 4 * c.hidden_size + 3 * c.intermediate_size + 2 * qkv + 2 * c.intermediate_size  # floats a row, parts too
    for n, attention in ((1, "rows"), (40, "prompt")):
        plan = TargetForward(exact_target).plan(n, attention)
        held = sum(t.numel() for t in plan.buffers.values())
        assert c.num_hidden_layers > 1 and 0 < held <= n * one_layer, (held, n * one_layer)


def test_speculative_decoding_on_the_blocks_is_plain_decoding(files, exact_target):
    """A draft of other weights (a perturbed model in bfloat16), chains and trees, several K: greedy output is the
    target's own, token for token, and sampled output with a seed is reproducible."""
    from specdec_core.models.tiny import tiny_tokenizer

    draft = random_model(1).to(torch.bfloat16)
    for written in ({}, {"target": TargetForward(exact_target)}):  # transformers' forward, then the written-out one
        pair = Pair("gguf", exact_target, draft, tiny_tokenizer(), 259, frozenset(), 4096, torch.device("cpu"),
                    torch.float32, written=written, pass_costs=NOMINAL_COSTS)
        ar = generate(pair, "blocks", SpecConfig(max_new_tokens=40), "autoregressive").token_ids
        for cfg in (SpecConfig(k=4, max_new_tokens=40), SpecConfig(k=8, max_new_tokens=40, tree_nodes=12)):
            assert generate(pair, "blocks", cfg).token_ids == ar
        sampled = SpecConfig(k=4, max_new_tokens=40, temperature=0.7, seed=5)
        assert generate(pair, "blocks", sampled).token_ids == generate(dataclasses.replace(pair), "blocks", sampled).token_ids


def test_a_lazy_model_reads_a_linears_values_only_when_no_quantised_weights_were_made(files, tmp_path):
    from specdec_core.models.quant import draft_to_int4

    reads = []

    def load():
        model = gguf_model.load_dense(files[0], torch.bfloat16, lazy=True)
        for m in model.modules():
            if hasattr(m, "values"):
                m.values = (lambda read: lambda: reads.append(1) or read())(m.values)
        return draft_to_int4(model, saved=tmp_path / "int4.safetensors", source="tiny")

    first = load()
    assert len(reads) == 15  # every Linear, once, to quantise it
    again = load()
    assert len(reads) == 15  # none: the saved weights were read instead
    ids = torch.tensor([[1, 5, 9, 200]])
    with torch.inference_mode():
        assert torch.equal(first(ids).logits, again(ids).logits)


@pytest.mark.parametrize("kind", [T.F32, T.F16, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_embedding_read_row_by_row_has_the_whole_tables_values(kind, dtype):
    """RowsEmbedding keeps the file's bytes and turns only the rows looked up into values: the same values, in the
    same dtype, as the whole table dequantised (what the embedding held before), for each type a Q4_K_M file holds."""
    from gguf.quants import quantize

    if kind in (T.Q4_K, T.Q6_K):
        needs_kernel()
    torch.manual_seed(0)
    values = torch.randn(48, 256)
    if kind in (T.Q4_K, T.Q6_K):  # gguf's quantiser has none for these
        raw = kquant.quantise(values, kquant.GGML_TYPES[kind]).reshape(-1)
    else:
        raw = torch.from_numpy(np.ascontiguousarray(quantize(values.numpy(), kind)).view(np.uint8).reshape(-1))
    table = gguf_file.dequantise(raw, kind, 48, 256).to(dtype)
    embedding = gguf_model.RowsEmbedding(raw, kind, 48, 256, dtype)
    ids = torch.tensor([[47, 0, 5, 5], [13, 2, 46, 1]])
    assert embedding.weight.shape == (48, 256) and embedding.weight.dtype == dtype
    assert torch.equal(embedding(ids), table[ids])
    with pytest.raises(IndexError, match="outside the embedding's 48 rows"):
        embedding(torch.tensor([48]))


def test_a_lazy_models_embedding_is_read_by_rows_with_the_same_values(files):
    needs_kernel()
    lazy = gguf_model.load_dense(files[0], torch.bfloat16, lazy=True).get_input_embeddings()
    table = gguf_model.load_dense(files[0], torch.bfloat16).get_input_embeddings()
    assert isinstance(lazy, gguf_model.RowsEmbedding) and isinstance(table, torch.nn.Embedding)
    ids = torch.arange(272)
    assert torch.equal(lazy(ids), table(ids))
