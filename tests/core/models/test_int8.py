"""The exact int8 target (models/int8.py, int8_vnni): its kernels against the reference arithmetic, and a position's
logits the same alone or in any pass."""
import copy
import dataclasses

import pytest
import torch
from safetensors import safe_open

from specdec_core import SpecConfig, generate
from specdec_core.cache import CachedModel
from specdec_core.models import int8
from specdec_core.models.int8 import TokenInt8Linear
from specdec_core.models.kernels import int8_vnni, native
from specdec_core.models.quant import quantise_target, replace_linears

from ...conftest import with_eos


def test_int8_weights_are_torchs_per_channel_quantisation():
    """int8_weights rounds each weight times its row's inverse scale, half to even: torch.quantize_per_channel's
    numbers, five times faster (the int8 target and the draft's twins are made from them at a first start). Ties are
    built exactly; the random rows are many, since dividing by the scale instead differs in a few in a million."""
    import warnings

    torch.manual_seed(0)
    w = torch.randn(4864, 896) * torch.rand(4864, 1) * 0.05
    w[0, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5]) * 2 ** -10  # the row's scale is 2^-10: exact ties
    lin = torch.nn.Linear(896, 4864, bias=False)
    lin.weight.data = w
    qweight, scale = int8.int8_weights(lin, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8).int_repr()
    assert qweight.dtype == torch.int8 and torch.equal(qweight, want)
    assert qweight[0, :6].tolist() == [127, 0, 2, 2, 0, -2]


class SharedScaleInt8(torch.nn.Module):
    """A planted bug: fbgemm's dynamic linear as it is, one activation range for all the rows of a call, so that a
    row's output depends on the rows beside it."""

    def __init__(self, lin: torch.nn.Linear):
        super().__init__()
        self.packed = int8.fbgemm_pack(*int8.int8_weights(lin, None), None if lin.bias is None else lin.bias.detach())
        self.out_features = lin.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic(x.reshape(-1, x.shape[-1]).float(), self.packed, True)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


KERNELS = ("fbgemm", "vnni")  # TokenInt8Linear's: ours where it runs, else fbgemm


@pytest.fixture(params=KERNELS)
def int8_kernel(request, monkeypatch):
    """Each int8 target test runs with each kernel, whatever this CPU has (ours needs AVX-512 VNNI)."""
    if request.param == "vnni" and int8_vnni.library()[0] is None:
        pytest.skip(f"the int8 kernel of our own cannot run here: {int8_vnni.library()[1]}")
    monkeypatch.setattr(int8, "vnni_fits", lambda in_features: request.param == "vnni")
    return request.param


def vnni_reference(packed: int8_vnni.Int8Product, qweight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What int8_vnni.c computes, in PyTorch: each row rounded against its largest magnitude, exact integer sums,
    then the same float32 operations."""
    top = x.abs().amax(-1, keepdim=True)
    xq = torch.round(x * torch.where(top > 0, 127 / top, 0.0)).long()
    n = packed.out_features
    y = (xq @ qweight.long().T).float() * (packed.scale[:n] * (top / 127))
    return y if packed.bias is None else y + packed.bias[:n]


@pytest.mark.parametrize("n, k, bias", [(40, 96, True), (64, 36, False), (259, 64, True)])
def test_the_vnni_product_is_the_reference_arithmetic_for_any_number_of_rows(n, k, bias):
    """Every row count through its tiles of 1 to 6 rows, outputs padded to 32 (40, 259), an odd number of 4-input
    steps (36): the same bits as the reference, so a row's output cannot depend on the rows beside it."""
    if int8_vnni.library()[0] is None:
        pytest.skip(f"the int8 kernel of our own cannot run here: {int8_vnni.library()[1]}")
    torch.manual_seed(0)
    qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n, dtype=torch.float64) / 100
    packed = int8_vnni.Int8Product(qweight, scale, torch.randn(n) if bias else None)
    x = torch.randn(65, k) * torch.rand(65, 1) * 10
    x[3] = 0  # a row of zeros: its scale is 0, not a division by it
    want = vnni_reference(packed, qweight, x)
    for rows in (*range(1, 14), 17, 65):
        assert torch.equal(packed(x[:rows]), want[:rows]), rows
    assert torch.equal(want[3], packed.bias[:n] if bias else torch.zeros(n))


def test_token_int8_rows_do_not_depend_on_the_other_rows(int8_kernel, monkeypatch):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 40)
    x = torch.randn(17, 96) * torch.rand(17, 1) * 10  # rows of very different sizes
    with torch.no_grad():
        for layer, independent in ((TokenInt8Linear(lin), True), (SharedScaleInt8(lin), False)):
            full = layer(x)
            alone = torch.cat([layer(x[i: i + 1]) for i in range(17)])
            assert torch.equal(full, alone) == independent, type(layer).__name__
            assert (full - lin(x)).abs().max() / lin(x).abs().max() < 0.03
        layer = TokenInt8Linear(lin)
        assert layer.kernel == int8_kernel
        # the kernels quantise the weights alike: a file saved with one serves the other
        monkeypatch.setattr(int8, "vnni_fits", lambda in_features: int8_kernel == "fbgemm")
        other, served = TokenInt8Linear(lin), TokenInt8Linear(lin, layer.saved_state())
        assert other.kernel == served.kernel != layer.kernel
        assert torch.equal(served(x), other(x))


def test_a_saved_vnni_layer_is_read_in_its_packed_layout_not_packed_again(monkeypatch):
    """A warm start reads the draft's int8 twins as the kernel takes them: packing 0.5B weights again cost a second."""
    if int8_vnni.library()[0] is None:
        pytest.skip(f"the int8 kernel of our own cannot run here: {int8_vnni.library()[1]}")
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(96, 40), torch.randn(7, 96)
    layer = TokenInt8Linear(lin)
    state = {key: value.clone() for key, value in layer.saved_state().items()}
    lib, packs = int8_vnni.library()[0], []

    class Watched:  # the kernel, its packing calls counted
        def __getattr__(self, name):
            packs.extend([name] if name == "int8_vnni_pack" else [])
            return getattr(lib, name)
    monkeypatch.setattr(int8_vnni, "library", lambda: (Watched(), ""))
    with torch.no_grad():
        assert torch.equal(TokenInt8Linear(lin)(x), layer(x)) and packs  # the watch sees a packing
        packs.clear()
        again = TokenInt8Linear(lin, state)
        assert again.kernel == "vnni" and not packs
        assert torch.equal(again(x), layer(x))


def test_where_ours_cannot_be_built_the_int8_target_keeps_fbgemm_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "cpu_flags", lambda: set(int8_vnni.NEEDS))
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    lin, x = torch.nn.Linear(64, 32), torch.randn(5, 64)
    try:
        for cc, why in (("no-such-compiler", "no C compiler"), ("false", "building it failed")):
            monkeypatch.setenv("CC", cc)
            int8_vnni.library.cache_clear()
            with pytest.warns(RuntimeWarning, match=why):
                layer = TokenInt8Linear(lin)
            assert layer.kernel == "fbgemm" and int8_vnni.library()[1].startswith(why)
            with torch.no_grad():
                assert torch.equal(layer(x), torch.cat([layer(x[i: i + 1]) for i in range(5)]))
            assert not list(tmp_path.rglob("*.so"))  # nothing half-built left behind
    finally:
        int8_vnni.library.cache_clear()


def test_the_target_quant_names_a_way_the_target_computes_not_a_kernel():
    from specdec_core import load_pair

    pair = load_pair("tiny", target_quant="int8")
    assert pair.info.target_quant == "int8"
    assert {m.kernel for m in pair.target.modules() if isinstance(m, TokenInt8Linear)} == {
        "vnni" if int8_vnni.library()[0] else "fbgemm"}
    for bad in ("int8:fbgemm", "int8:vnni", "off:vnni", "int4", "blocks:vnni"):
        with pytest.raises(ValueError, match="target_quant must be auto, off, blocks or int8"):
            load_pair("tiny", target_quant=bad)
    with pytest.raises(ValueError, match="multiple of 256 inputs"):
        load_pair("tiny", target_quant="blocks")


def logits_alone_and_in_a_pass(model, vocab, context: int = 57, written=None):
    """The logits of 17 positions fed one at a time, as plain decoding does, and the same positions inside one
    17-token chain pass; and, for a tree whose branch 0 -> 2 -> 5 -> ... holds those tokens among other nodes,
    that branch's rows of the tree pass, beside the same tokens fed alone. written: the model's written-out forward."""
    from specdec_core.cache import CachedModel, TreeInput

    prompt, pass_ids = [3 + i % 90 for i in range(context)], torch.arange(100, 117)
    lm = CachedModel(model, vocab, written=written)
    lm.prefill(prompt)
    full = lm.forward(pass_ids, keep=17)
    lm.crop(len(prompt))
    alone = torch.stack([lm.forward(pass_ids[i: i + 1], keep=1)[0] for i in range(17)])  # one at a time, as AR does
    # a tree: node i's parent is i - 2 (i >= 2), so 0 -> 2 -> 4 ... and 1 -> 3 -> 5 ... are two branches
    lm.crop(len(prompt))
    parents = [-1, -1] + list(range(15))
    tree = lm.forward(pass_ids, keep=17, tree=TreeInput(parents))
    lm.crop(len(prompt))
    branch = pass_ids[0::2]
    branch_alone = torch.stack([lm.forward(branch[i: i + 1], keep=1)[0] for i in range(len(branch))])
    return alone, full, tree[0::2], branch_alone


@pytest.mark.parametrize("context", [57, 300])
def test_the_int8_target_gives_a_position_the_same_logits_alone_or_in_a_pass(tiny, context, int8_kernel):
    target = quantise_target(copy.deepcopy(tiny.target).to(torch.bfloat16))
    assert next(target.parameters()).dtype == torch.float32
    assert {m.kernel for m in target.modules() if isinstance(m, TokenInt8Linear)} == {int8_kernel}
    alone, full, tree, branch_alone = logits_alone_and_in_a_pass(target, tiny.vocab, context)
    assert torch.equal(alone, full)
    assert torch.equal(tree, branch_alone)
    # the same layers with one activation scale for the whole pass give another function
    shared = replace_linears(copy.deepcopy(tiny.target), lambda name, mod: SharedScaleInt8(mod))
    alone, full, tree, branch_alone = logits_alone_and_in_a_pass(shared, tiny.vocab, context)
    assert (alone - full).abs().max() > 1e-3 and (tree - branch_alone).abs().max() > 1e-3


def test_the_int8_target_is_exact_with_one_key_value_head(tiny):
    """With one key/value head (multi-query attention, as some Hub models have) each head's product is a batch of
    one, and MKL then sums a row differently with the number of rows beside it: batched, every row of a pass here
    differed from its step. The probe (attention.rows_agree) finds that, and each row gets a step's product."""
    from transformers import Qwen2ForCausalLM

    from specdec_core.models import attention
    from specdec_core.models.tiny import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config(tiny.vocab, hidden=96, heads=6, kv_heads=1)
    target = quantise_target(Qwen2ForCausalLM(cfg).eval())
    alone, full, tree, branch_alone = logits_alone_and_in_a_pass(target, tiny.vocab)
    assert torch.equal(alone, full)
    assert torch.equal(tree, branch_alone)
    assert ("cpu", torch.float32, 1, 6, 16) in attention._agrees


def test_the_int8_target_reads_a_prompt_in_one_call_a_layer_and_a_pass_in_one_product_per_key_width(tiny, monkeypatch):
    """Both decoders compute a prompt alike, so it needs no step's arithmetic; every decoding position does: a pass's
    rows that read keys of one padded width share the kernel a step runs."""
    from specdec_core.models import attention

    target, calls = quantise_target(copy.deepcopy(tiny.target)), []
    sdpa, attend = torch.nn.functional.scaled_dot_product_attention, attention.attend
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *args, **kw: calls.append(("prompt", args[2].shape[2])) or sdpa(*args, **kw))
    monkeypatch.setattr(attention, "attend", lambda q, k, *a: calls.append((q.shape[1], k.shape[-2])) or attend(q, k, *a))
    lm, layers = CachedModel(target, tiny.vocab), target.config.num_hidden_layers
    lm.prefill(list(range(3, 203)))
    assert calls == [("prompt", 200)] * layers
    calls.clear()
    lm.forward(torch.arange(5, 22), keep=17)  # rows 201 to 217 keys wide: all padded to 256
    assert calls == [(17, 256)] * layers
    calls.clear()
    lm.forward(torch.arange(5, 6), keep=1)
    assert calls == [(1, 256)] * layers


@pytest.mark.parametrize("k", [1, 4, 16])
def test_the_int8_target_decodes_losslessly_and_is_saved(tiny, tmp_path, k, int8_kernel):
    path = tmp_path / "target-int8.safetensors"
    target = quantise_target(copy.deepcopy(tiny.target), saved=path, source="weights v1")
    again = quantise_target(copy.deepcopy(tiny.target), saved=path, source="weights v1")
    layers = [m for model in (target, again) for m in model.modules() if isinstance(m, TokenInt8Linear)]
    assert {m.kernel for m in layers} == {int8_kernel}
    with safe_open(str(path), "pt") as f:  # each kernel's own layout is kept: read again as it is
        fields = {key.rpartition(":")[2] for key in f.keys()}
    assert fields == ({"weight", "colsum", "scale"} if int8_kernel == "vnni" else {"qweight", "scale"})
    with torch.inference_mode():
        x = torch.tensor([[5, 17, 42, 99, 7]])
        assert torch.equal(target(x).logits, again(x).logits)
    pair = dataclasses.replace(with_eos(tiny, []), target=target, heads={})
    cfg = SpecConfig(k=k, max_new_tokens=48)
    spec = generate(pair, "int8 target", cfg)
    assert spec.token_ids == generate(pair, "int8 target", cfg, "autoregressive").token_ids
    assert 0 < spec.stats.acceptance_rate < 1


def test_a_file_in_the_other_int8_layout_is_made_again_in_the_one_read_here(tiny, tmp_path, monkeypatch):
    if int8_vnni.library()[0] is None:
        pytest.skip(f"the int8 kernel of our own cannot run here: {int8_vnni.library()[1]}")
    path = tmp_path / "target-int8.safetensors"

    def fields():
        with safe_open(str(path), "pt") as f:
            return {key.rpartition(":")[2] for key in f.keys()}, f.metadata()["source"]
    with monkeypatch.context() as m:
        m.setattr(int8, "vnni_fits", lambda in_features: False)  # made where only fbgemm runs
        quantise_target(copy.deepcopy(tiny.target), saved=path, source="weights v1")
    assert fields()[0] == {"qweight", "scale"} and fields()[1].endswith("int8 rows")
    target = quantise_target(copy.deepcopy(tiny.target), saved=path, source="weights v1")
    assert fields()[0] == {"weight", "colsum", "scale"} and fields()[1].endswith("int8 tiles")
    assert {m.kernel for m in target.modules() if isinstance(m, TokenInt8Linear)} == {"vnni"}


def test_compiled_steps_refuse_to_replace_the_exact_targets_attention():
    """Compiled steps set their own attention; over the int8 target that would lose exactness without a word."""
    from specdec_core import load_pair

    with pytest.raises(ValueError, match="exact"):
        load_pair("tiny", target_quant="int8", graphs="inductor")
    pair = load_pair("tiny", target_quant="int8")  # no compiled steps: the exact target as it is
    assert pair.target.config._attn_implementation == "specdec_rows" and not pair.compiled
