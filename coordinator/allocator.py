"""Keep the server's freed tensor memory in the process instead of handing it back every step.

Problem: PyTorch's CPU tensors come from the C library's ``malloc``. With glibc's defaults a
block above the mmap threshold (128 kB at first) is mapped fresh from the kernel when it is
allocated and unmapped when it is freed, and free memory at the top of the heap above the trim
threshold is returned to the kernel. A server step allocates and frees blocks of that size
every time (each agent's decoded rows, the merged batch, the activations autograd keeps, each
agent's gradient, the encode buffers), so every step pays the kernel again to map, zero and
fault in the same pages: system time the coordinator spends for nothing, on the thread that
also trains. glibc raises its threshold by itself only after a mapped block is freed, and
only up to the size of that block.

What this does: one call at the start of ``sfl-coord serve`` (and ``simulate``) tells glibc
never to map a block by itself (``M_MMAP_MAX`` 0: every block comes from the heap, however
large: a step of 200 agents' rows allocates blocks above the 32 MiB that glibc's own
threshold reaches) and to keep up to 1 GiB of free memory at the heap's top
(``M_TRIM_THRESHOLD``), so a step reuses the pages the last step freed. Why that much: with
500 agents a round a step frees more than 256 MiB at once (the merged rows, their gradient,
each agent's decoded rows and gradient), and whatever lies over the threshold goes back to the
kernel and is faulted in again by the next step. The price: up to 1 GiB of freed memory stays
with the process instead of going back to the system, and the process's resident size
includes it.

Only where it applies: glibc (Linux; not musl, macOS or Windows); not when the operator has
tuned malloc already (any ``MALLOC_*`` variable or ``GLIBC_TUNABLES``) or replaced it
(``LD_PRELOAD`` of jemalloc or tcmalloc, as PyTorch's performance guide suggests). It changes
how memory is reused, never what is computed.
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["keep_freed_memory"]

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**30
"""Free memory at the heap's top kept before any is returned to the system."""


def _operator_tuned(environ: "os._Environ[str] | dict[str, str]") -> bool:
    """True where the operator chose the allocator's behaviour themselves."""
    return (any(k.startswith("MALLOC_") for k in environ) or "GLIBC_TUNABLES" in environ
            or any(name in environ.get("LD_PRELOAD", "") for name in ("jemalloc", "tcmalloc", "mimalloc")))


def keep_freed_memory(environ: "os._Environ[str] | dict[str, str] | None" = None) -> bool:
    """Tell glibc to take every block from its heap and keep up to ``TRIM_THRESHOLD`` free there
    (see the module's docstring). True if glibc took both settings; False where this is not
    glibc or the operator tuned or replaced malloc."""
    environ = os.environ if environ is None else environ
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or _operator_tuned(environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # glibc returns 1 on success; setting either also stops glibc adjusting its thresholds itself
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
