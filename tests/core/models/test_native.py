"""Kernels fit to ship: explicit instruction sets, names keyed on source and flags, one build at a time across
processes, and no loading from a directory that someone else can write to."""
import fcntl
import os
import threading
import time

import pytest
import torch

from specdec_core.models import int8, quant
from specdec_core.models.kernels import int4_vnni, int8_vnni, kquant, native, step_ops

KERNELS = {"int8": int8_vnni.FLAGS,  # and every build of the others, as native.BUILDS gives their flags
           **{f"{name}-{build}": common + flags for name, common in (("step", step_ops.FLAGS), ("int4", int4_vnni.COMMON),
                                                                     ("kquant", kquant.COMMON))
              for build, (_, flags) in native.BUILDS.items()}}


@pytest.mark.parametrize("name", KERNELS)
def test_kernels_name_their_instruction_sets(name):
    """-march=native makes a file that runs only on this CPU model; a shared cache would hand it to others."""
    assert not any(flag.startswith(("-march", "-mtune=native")) for flag in KERNELS[name])


def source(tmp_path, body="int version(void) { return 7; }"):
    path = tmp_path / "kernel.c"
    path.write_text(body)
    return path


def test_a_builds_name_is_keyed_on_source_and_flags_not_on_the_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    kernel = source(tmp_path)
    for cpu in ({"avx2"}, {"avx2", "avx512f"}):  # one CPU, then another, on one shared cache
        monkeypatch.setattr(native, "cpu_flags", lambda: cpu)
        lib, why = native.load(kernel, ["-O1", "-shared", "-fPIC"], set(), "{why}")
        assert why == "" and lib.version() == 7
    assert len(list((tmp_path / "cache" / "kernels").glob("kernel-*.so"))) == 1


def test_the_kernel_directory_is_private_and_checked(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    kernel = source(tmp_path)
    lib, why = native.build(kernel, ["-O1", "-shared", "-fPIC"])
    folder = tmp_path / "cache" / "kernels"
    assert lib is not None and (folder.stat().st_mode & 0o777) == 0o700
    folder.chmod(0o777)  # anyone could put a library of theirs under the expected name
    lib, why = native.build(kernel, ["-O1", "-shared", "-fPIC"])
    assert lib is None and "writable by other users" in why


def test_two_processes_build_one_after_the_other(monkeypatch, tmp_path):
    """The build holds a lock file in the kernel directory: while another process holds it, this one waits."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "kernels"
    folder.mkdir(parents=True, mode=0o700)
    done = []
    with open(folder / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process is building
        worker = threading.Thread(target=lambda: done.append(native.build(source(tmp_path), ["-O1", "-shared", "-fPIC"])))
        worker.start()
        time.sleep(1.0)
        assert not done  # it waits for the other build
        fcntl.flock(held, fcntl.LOCK_UN)
    worker.join(60)
    assert done and done[0][0] is not None
    assert os.path.exists(folder / ".lock")


def test_a_kernel_built_from_another_source_or_with_other_flags_leaves_the_other_builds(monkeypatch, tmp_path):
    """A cache may be shared by versions of the code and CPUs: a build never removes another build's file."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    source = tmp_path / "kernel.c"
    for version, flags in ((1, ["-O1"]), (2, ["-O1"]), (2, ["-O2"]), (1, ["-O1"])):
        source.write_text(f"int version(void) {{ return {version}; }}")
        lib, why = native.build(source, [*flags, "-shared", "-fPIC"])
        assert why == "" and lib.version() == version
    assert len(list((tmp_path / "kernels").glob("kernel-*.so"))) == 3


def test_the_kernels_wrappers_refuse_rows_of_another_shape_or_type():
    """A ctypes call reads what it is given: rows of another width would be read past their end."""
    if int4_vnni.library()[0] is None or int8_vnni.library()[0] is None:
        pytest.skip("our int4 and int8 products cannot be built here")
    int4 = quant.Int4Linear(torch.nn.Linear(64, 32).bfloat16(), kernel="vnni")
    with pytest.raises(ValueError, match="bfloat16 rows of 64"):
        int4.matmul(torch.randn(2, 128).bfloat16())
    with pytest.raises(ValueError, match="bfloat16 rows of 64"):
        int4_vnni.product(int4.tiles, torch.randn(2, 64), 32, 64)
    int8 = int8_vnni.Int8Product(torch.ones(32, 64, dtype=torch.int8), torch.ones(32, dtype=torch.float64), None)
    with pytest.raises(ValueError, match="float32 rows of 64"):
        int8(torch.randn(2, 96))


def test_the_kernels_can_be_turned_off_and_the_fallbacks_run(monkeypatch, tmp_path):
    """SPECDEC_KERNELS=off: none of ours is built or loaded; the int8 target and the int4 draft keep PyTorch's."""
    from specdec_core.models.kernels import kquant

    monkeypatch.setenv("SPECDEC_KERNELS", "off")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    libraries = (int8_vnni.library, int4_vnni.library, kquant.library)
    for library in libraries:
        library.cache_clear()
    try:
        for library in libraries:
            assert library() == (None, "turned off by SPECDEC_KERNELS=off")
        assert not (tmp_path / "kernels").exists()
        assert int8.TokenInt8Linear(torch.nn.Linear(64, 32)).kernel == "fbgemm"
        assert quant.Int4Linear(torch.nn.Linear(64, 32).bfloat16()).tiles is None
    finally:
        for library in libraries:
            library.cache_clear()


def test_the_avx2_builds_can_be_asked_for_on_a_cpu_with_avx512(monkeypatch):
    """SPECDEC_KERNELS=avx2: each kernel takes the build of a CPU without AVX-512 (how docs/benchmarks.md measures
    one on a CPU with it), and computes there."""
    from specdec_core.models import load
    from specdec_core.models.kernels import kquant

    if not native.AVX2 <= native.cpu_flags() or not native.AVX512_VNNI <= native.cpu_flags():
        pytest.skip("this CPU cannot run both builds")
    monkeypatch.setenv("SPECDEC_KERNELS", "avx2")
    libraries = (int8_vnni.library, int4_vnni.library, kquant.library)
    for library in libraries:
        library.cache_clear()
    try:
        assert not any(flag.startswith("avx512") for flag in native.cpu_flags()) and native.AVX2 <= native.cpu_flags()
        assert kquant.library()[1] == int4_vnni.library()[1] == "avx2" and int8_vnni.library()[0] is None
        assert load.auto_target_quant("bundled", torch.device("cpu")) == "blocks"
        layer = quant.Int4Linear(torch.nn.Linear(256, 32).bfloat16())
        x = torch.randn(3, 256).bfloat16()
        assert layer.tiles is not None and torch.equal(layer(x), torch.cat([layer(x[i: i + 1]) for i in range(3)]))
    finally:
        for library in libraries:
            library.cache_clear()
