"""What an unlucky operator meets: no compiler, locks held or unopenable, broken kernel files, damaged parts, cache files
of the wrong shape, leftovers of a killed start, a chart export that hangs, and a long prompt."""
import copy
import fcntl
import hashlib
import subprocess
import sys
import threading
import time

import pytest
import torch

from specdec_core import SpecConfig, autoregressive_generate, speculative_generate
from specdec_core.events import RoundEvent
from specdec_core.messages import Refusal
from specdec_core.models import bundled
from specdec_core.models.kernels import kquant, native
from specdec_core.models.quant import draft_to_int4
from specdec_core.models.tiny import tiny_models

FLAGS = ["-O1", "-shared", "-fPIC"]


def source(tmp_path, body="int version(void) { return 7; }"):
    path = tmp_path / "kernel.c"
    path.write_text(body)
    return path


@pytest.mark.parametrize("kind", [4, 6])
def test_blocks_are_read_in_pytorch_as_the_kernel_reads_them(kind):
    """Without a compiler the blocks are still read (an embedding's rows, a draft's values): the same bits."""
    if kquant.library()[0] is None:
        pytest.skip("no kernel to compare with")
    torch.manual_seed(kind)
    raw = kquant.quantise(torch.randn(40, 512) * torch.rand(40, 1) * 3, kind)
    ids = torch.tensor([39, 0, 7, 7, 20])
    assert torch.equal(kquant.rows_in_torch(raw, kind, 512, ids), kquant.dequantise_rows(raw, kind, 512, ids))
    ref = __import__("gguf").quants.dequantize(raw.numpy(), 12 if kind == 4 else 14)  # the format's reference reader
    assert torch.equal(kquant.rows_in_torch(raw, kind, 512, torch.arange(40)), torch.from_numpy(ref))


def test_without_kernels_a_gguf_target_and_draft_load_and_decode_exactly(monkeypatch, tmp_path):
    """SPECDEC_KERNELS=off: no C at all; the file's blocks are read in PyTorch, the target made int8 (exact)."""
    from specdec_core.models.kernels import int4_vnni, int8_vnni
    from specdec_core.models.gguf_model import load_dense, load_target
    from .models.test_gguf_model import random_model, write_gguf

    write_gguf(random_model(0), tmp_path / "t.gguf")
    monkeypatch.setenv("SPECDEC_KERNELS", "off")
    libraries = (int8_vnni.library, int4_vnni.library, kquant.library)
    for library in libraries:
        library.cache_clear()
    try:
        model = load_dense(tmp_path / "t.gguf", torch.float32)
        assert kquant.library()[0] is None and model.lm_head.weight.shape == (272, 256)
        with pytest.raises(RuntimeError, match="not available"):
            load_target(tmp_path / "t.gguf")  # the blocks' product itself needs the kernel
    finally:
        for library in libraries:
            library.cache_clear()
    assert torch.equal(model.lm_head.weight, load_dense(tmp_path / "t.gguf", torch.float32).lm_head.weight)


@pytest.mark.slow
@pytest.mark.bundled
def test_without_kernels_the_bundled_pair_loads_and_decodes_exactly(tmp_path):
    """In a process of its own, as an operator without a compiler starts it; every round drafts as far as asked
    (NOMINAL_COSTS), where the policy would take plain steps that check no draft."""
    code = ("import dataclasses; from specdec_core import load_pair, SpecConfig, generate; "
            "from specdec_core.models.tiny import NOMINAL_COSTS; p = load_pair('bundled'); "
            "cfg = SpecConfig(max_new_tokens=24); prompt = 'Write a Python function that adds two numbers.'; "
            "a = generate(dataclasses.replace(p, pass_costs=NOMINAL_COSTS), prompt, cfg); "
            "b = generate(p, prompt, cfg, 'autoregressive'); print('PLAIN', a.stats.plain_steps); "
            "print('WEIGHTS', p.info.target_weights, p.info.draft_quant); print('SAME', a.token_ids == b.token_ids)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1200,
                         env={**__import__("os").environ, "SPECDEC_KERNELS": "off", "SPECDEC_CACHE": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "WEIGHTS int8" in out.stdout and "SAME True" in out.stdout and "PLAIN 0" in out.stdout
    assert not (tmp_path / "kernels").exists()


def test_a_lock_held_too_long_ends_the_wait_with_a_message(tmp_path):
    with open(tmp_path / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process, alive, holding it
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="another process"):
            with native.locked(tmp_path, timeout_s=0.5):
                pass
        assert time.monotonic() - t0 < 3


def test_a_valid_cache_file_is_read_where_its_lock_cannot_be_opened(tmp_path):
    _, draft, _ = tiny_models()
    path = tmp_path / "draft-int4.safetensors"
    draft_to_int4(copy.deepcopy(draft).to(torch.bfloat16), saved=path, source="tiny")
    stamp = path.stat().st_mtime_ns
    lock = tmp_path / (path.name + ".lock")
    lock.unlink(missing_ok=True)
    lock.mkdir()  # opening it as a file fails
    draft_to_int4(copy.deepcopy(draft).to(torch.bfloat16), saved=path, source="tiny")
    assert path.stat().st_mtime_ns == stamp  # read, not made again


def test_a_built_kernel_is_loaded_where_the_lock_cannot_be_opened(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    assert native.build(source(tmp_path), FLAGS)[1] == ""
    (tmp_path / "kernels" / ".lock").unlink()
    (tmp_path / "kernels" / ".lock").mkdir()
    lib, why = native.build(source(tmp_path), FLAGS)
    assert why == "" and lib.version() == 7


@pytest.mark.parametrize("damage", ["garbage", "truncated", "another library"])
def test_a_broken_kernel_file_is_built_again(monkeypatch, tmp_path, damage):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    kernel = source(tmp_path)
    native.build(kernel, FLAGS)
    built = next((tmp_path / "kernels").glob("kernel-*.so"))
    if damage == "garbage":
        data = b"not a library"
    elif damage == "truncated":
        data = built.read_bytes()[:1000]
    else:  # a valid library, but not this source's build
        native.build(source(tmp_path / "kernels", "int version(void) { return 8; }"), FLAGS)
        data = next(p for p in (tmp_path / "kernels").glob("kernel-*.so") if p != built).read_bytes()
    swap = built.with_suffix(".new")  # a file of its own, as a later start finds it (this one has the other mapped)
    swap.write_bytes(data)
    swap.replace(built)
    # a later start, in a process of its own (this one has the first file loaded under that name)
    code = (f"from pathlib import Path; from specdec_core.models.kernels import native; "
            f"lib, why = native.build(Path({str(kernel)!r}), {FLAGS!r}); print('VERSION', lib and lib.version(), why)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "VERSION 7 " in out.stdout, out.stdout + out.stderr[-1000:]


def test_a_killed_starts_leftovers_are_removed_at_the_next_start(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    native.build(source(tmp_path), FLAGS)
    left = [tmp_path / "kernels" / "tmpab12cd", tmp_path / "tmpzz99"]
    for folder in left:
        folder.mkdir()
        (folder / "kernel-0.so").write_bytes(b"half")
    native.build(source(tmp_path), FLAGS)  # a start: the kernel is built already
    native.remove_leftovers(tmp_path)
    assert not any(p.exists() for p in left)


def test_a_damaged_part_is_said_to_need_a_reinstall_before_anything_parses_it(tmp_path, monkeypatch):
    parts = {"t": [tmp_path / "t1"], "d": [tmp_path / "d1"]}
    parts["t"][0].write_bytes(b"GGUF" + b"\0" * 60)
    parts["d"][0].write_bytes(b"GGUF" + b"\1" * 60)
    model = lambda key: bundled.BundledModel(key, key, key, 1, hashlib.sha256(parts[key][0].read_bytes()).hexdigest(), 64)
    monkeypatch.setattr(bundled, "TARGET", model("t"))
    monkeypatch.setattr(bundled, "DRAFT", model("d"))
    monkeypatch.setattr(bundled, "part_paths", lambda m: parts[m.slug])
    parts["d"][0].write_bytes(b"GGUF" + b"\2" * 60)  # damaged after install
    (tmp_path / "tmp_tokenizer").mkdir()  # and a killed start's temporary tokenizer folder
    with pytest.raises(Refusal) as refused:
        bundled.load_bundled(torch.device("cpu"), torch.float32, lambda f, m: None, tmp_path)
    assert refused.value.key == "bundled_damaged" and "d" == refused.value.values["name"]
    assert not (tmp_path / "tmp_tokenizer").exists()


@pytest.mark.parametrize("role", ["draft", "target"])
def test_cached_tensors_of_the_wrong_shape_are_made_again_never_read(tmp_path, role):
    """A cache file with a valid digest and source whose tensor has another shape (a file from another model of the
    same name, or edited): the layers are made again from the model, never handed to a kernel."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from specdec_core.models.files import file_digest
    from specdec_core.models.quant import quantise_target

    _, draft, _ = tiny_models()
    path = tmp_path / f"{role}.safetensors"
    make = (lambda m: draft_to_int4(m.to(torch.bfloat16), saved=path, source="tiny")) if role == "draft" else \
        (lambda m: quantise_target(m.float(), saved=path, source="tiny"))
    x = torch.randn(2, draft.config.hidden_size)
    layer = lambda m: m.model.layers[0].mlp.up_proj
    want = layer(make(copy.deepcopy(draft)))(x.to(torch.bfloat16 if role == "draft" else torch.float32))
    with safe_open(str(path), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    key = next(k for k in tensors if k.startswith("model.layers.0.mlp.up_proj:") and tensors[k].dim() >= 2)
    tensors[key] = tensors[key][: len(tensors[key]) // 2].clone()  # half the rows
    save_file(tensors, str(path), metadata=meta)
    path.with_name(path.name + ".sha256").write_text(file_digest(path))
    got = layer(make(copy.deepcopy(draft)))(x.to(torch.bfloat16 if role == "draft" else torch.float32))
    assert torch.equal(got, want)
    with safe_open(str(path), "pt") as f:
        assert f.get_tensor(key).shape != tensors[key].shape  # the file was made again


def test_a_chart_export_that_hangs_is_given_up(tmp_path, monkeypatch, capsys):
    import plotly.graph_objects as go

    from specdec_core.bench import chart

    monkeypatch.setattr(go.Figure, "write_image", lambda self, path: threading.Event().wait())
    monkeypatch.setattr(chart, "PNG_TIMEOUT_S", 0.5)
    report = {"prompts": [{"category": "code", "id": "a", "speedup": 1.5}], "settings": {"drafter": "model", "k": 4,
              "max_new_tokens": 8}, "pair": "tiny", "device": "cpu", "target_weights": "float32"}
    t0 = time.monotonic()
    chart.chart(report, tmp_path / "chart.png")
    assert time.monotonic() - t0 < 10 and "timed out" in capsys.readouterr().out
    assert (tmp_path / "chart.html").exists()


@pytest.mark.parametrize("method", ["speculative", "autoregressive"])
def test_a_long_prompt_is_read_in_chunks_with_the_same_output(tiny, monkeypatch, method):
    """With progress asked for, the prefill yields between chunks (Prefilling), then the rounds are as without."""
    from specdec_core import cache
    from specdec_core.events import Prefilling

    monkeypatch.setattr(cache, "PROMPT_CHUNK", 32)
    prompt = "a long prompt " * 20
    cfg = SpecConfig(k=3, max_new_tokens=12)
    run = speculative_generate if method == "speculative" else autoregressive_generate
    plain = [e.committed for e in run(tiny, prompt, cfg)]
    events = list(run(tiny, prompt, cfg, progress=True))
    steps = [e for e in events if isinstance(e, Prefilling)]
    rounds = [e for e in events if isinstance(e, RoundEvent)]
    assert len([s for s in steps if s.model == "target"]) > steps[0].total // 32 and events[: len(steps)] == steps
    assert [s.done for s in steps if s.model == "target"] == sorted(s.done for s in steps if s.model == "target")
    assert {s.model for s in steps} == ({"target", "draft"} if method == "speculative" else {"target"})
    assert [e.committed for e in rounds] == plain
    assert rounds[0].prefill_s >= steps[-1].elapsed_s
