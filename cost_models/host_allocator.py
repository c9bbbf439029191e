"""A CPU rank keeps the memory it frees for its next step, as CUDA's caching allocator does on a GPU.

PyTorch allocates CPU tensors with the C library's allocator. glibc's hands a block above its mmap
threshold back to the operating system when it is freed, and trims the free top of its heap; the next
step's tensors then fault their pages in afresh (the kernel zeroes each one). A rank that holds many
micro-batches at once pays that every step: on a 2-rank GPT pipeline (``benchmarks/schedule_bubbles.py``),
GPipe's stages faulted 2,500-4,800 pages a step, where 1F1B's, which reuse one micro-batch's memory for the
next, faulted none, and GPipe's forwards and backwards ran 6-16% slower than 1F1B's same actions. With
glibc told to serve blocks up to its ceiling from the heap and never to trim it, both fault none after
the first step and run alike. torch has no CPU caching allocator to turn on; glibc's ``mallopt`` is the
knob. The run's processes hold their peak from then on (as a GPU's cached blocks do). The runtime's CPU
ranks and the processes that measure gloo for the cpu device both start so (``cpu_device.settle_cpu_rank``).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX_BYTES = 32 * 2**20  # the largest glibc accepts on a 64-bit machine (HEAP_MAX_SIZE / 2)
NEVER_TRIM_BYTES = 2**31 - 1  # mallopt takes a C int


def keep_freed_memory() -> bool:
    """Tell this process's allocator to keep freed blocks of up to 32 MiB for reuse (glibc only).

    Returns whether it could: False where the C library is not glibc (no ``mallopt``), which then
    allocates as it always does. Blocks above 32 MiB are still mapped and unmapped each time."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, NEVER_TRIM_BYTES))
