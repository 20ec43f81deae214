"""Adaptive decode threads in the real daemon, and the OpenMP spin window it starts with.

The others' load comes from a file the test writes (SFCORE_CPU_LOAD_FILE, read by
system/cpuload.py instead of the kernel's counters): the machine running the tests is
busy with other work anyway, so only a load the test decides gives the same result on
every run. The test looks at `stats` every few streamed tokens (events, not a clock),
within a deadline; nothing sleeps. The policy's logic itself is
tests/unit/engine/test_threadpolicy.py.

This file holds the tests that need no daemon and no model; those against the real
daemon in tests/e2e/ndjson/test_adaptive_threads.py.
"""

from __future__ import annotations

import time

from sfcore_daemon.system import openmp


def test_the_spin_default_never_overrides_the_user() -> None:
    environ: dict[str, str] = {}
    openmp.set_spin_default(environ)
    assert environ == {"GOMP_SPINCOUNT": openmp.SPIN_DEFAULT}
    for own in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "active"}):
        environ = dict(own)
        openmp.set_spin_default(environ)
        assert environ == own


def test_the_runtime_is_read_from_the_mapped_files() -> None:
    assert openmp.runtime_in(["/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0"]) == "GNU libgomp"
    assert openmp.runtime_in(["/opt/llvm/lib/libomp.so.5"]) == "LLVM libomp"
    assert openmp.runtime_in(["/opt/intel/lib/libiomp5.so"]) == "Intel libiomp"
    assert openmp.runtime_in(["/lib/libggml-cpu.so", "[heap]"]) is None
    assert "GOMP_SPINCOUNT=3k" in openmp.describe({"GOMP_SPINCOUNT": "3k"},
                                                  ["/lib/libgomp.so.1"])
    assert "300,000 spins" in openmp.describe({}, ["/lib/libgomp.so.1"])
    assert "0 spins" in openmp.describe({"OMP_WAIT_POLICY": "PASSIVE"}, ["/lib/libgomp.so.1"])
    assert "never sleeps" in openmp.describe({}, [])
    assert "no effect" in openmp.describe({}, ["/x/libomp.so"])


def test_this_process_maps_libgomp_once_llama_cpp_is_loaded() -> None:
    from sfcore_daemon.llama.capi import C

    assert C.llama_max_devices() >= 1
    assert openmp.runtime_in(openmp.mapped_paths()) == "GNU libgomp"


def test_the_load_sampler_reads_the_counters() -> None:
    from sfcore_daemon.system.cpuload import OtherLoad

    sampler = OtherLoad([0])
    assert sampler.sample() is None  # a first reading has nothing to compare with
    # Asked again, it answers a load within the CPU set, whatever the machine does.
    deadline = time.monotonic() + 10
    while (others := sampler.sample()) is None:
        assert time.monotonic() < deadline
    assert 0.0 <= others <= 1.0
