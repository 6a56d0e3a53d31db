"""Kernels fit to ship: explicit instruction sets, names keyed on source and flags, one build at a time across
processes, and no loading from a directory that someone else can write to."""
import fcntl
import os
import threading
import time

import pytest

from specdec_core.models import int4_vnni, int8_vnni, kquant, native, step

KERNELS = {"int8": int8_vnni.FLAGS, "int4": int4_vnni.FLAGS, "step": step.FLAGS,
           "kquant": kquant.COMMON + native.AVX512_VNNI_FLAGS}


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
