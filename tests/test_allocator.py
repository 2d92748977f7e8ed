"""The coordinator's allocator setting (:mod:`coordinator.allocator`): freed blocks of a server
step's sizes are reused from the heap instead of being mapped, zeroed and faulted in again, and
an operator's own malloc tuning is left alone."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

from coordinator.allocator import keep_freed_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# a fresh process: malloc, touch and free one block of argv[2] MiB twice (40 MiB: above the 32 MiB that
# glibc's own threshold reaches, so glibc maps it afresh each time by default; 320 MiB: more than a
# step of 500 agents frees at once, over the 256 MiB once kept); the page faults of the second time
_REUSE = textwrap.dedent("""
    import ctypes, resource, sys
    from coordinator.allocator import keep_freed_memory
    if sys.argv[1] == "keep":
        assert keep_freed_memory({})
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    faults = []
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        size = int(sys.argv[2]) << 20
        p = libc.malloc(size)
        ctypes.memset(p, 1, size)
        libc.free(p)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(faults[1])
""")


def _second_time_faults(mode: str, mib: int) -> int:
    out = subprocess.run([sys.executable, "-c", _REUSE, mode, str(mib)], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not GLIBC, reason="the setting exists only in glibc")
@pytest.mark.parametrize("mib", [40, 320])
def test_a_freed_block_is_reused_without_faulting_its_pages_in_again(mib):
    pages = (mib << 20) // 4096
    kept, default = _second_time_faults("keep", mib), _second_time_faults("default", mib)
    assert kept < pages // 10, f"{kept} page faults for a block freed just before (of {pages} pages)"
    assert default > pages // 2, f"glibc's default faulted only {default} of {pages} pages in again"


@pytest.mark.parametrize("environ", [{"MALLOC_ARENA_MAX": "2"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
                                     {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
                                     {"LD_PRELOAD": "libtcmalloc_minimal.so.4"}])
def test_an_operators_own_malloc_tuning_or_allocator_is_left_alone(environ):
    assert keep_freed_memory(environ) is False

