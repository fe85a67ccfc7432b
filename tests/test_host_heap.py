"""jax_mlpo.return_freed_buffers: large blocks freed by the process go back to the system.

glibc's malloc raises its mmap threshold to the size of each mmapped block it frees; blocks
below the new threshold then come from the heap, which keeps what is freed. Each case runs in
a fresh interpreter (the setting is process-wide) and reads ``mallinfo2``'s bytes in mmapped
regions while a 4 MiB block is held, after an 8 MiB block was allocated and freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import subprocess
import sys

import pytest

import jax_mlpo

_PROBE = """
import ctypes, ctypes.util, json, sys
from jax_mlpo.engine.host_heap import return_freed_buffers

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
fixed = sys.argv[1] == "fixed" and return_freed_buffers()
libc.free(libc.malloc(8 << 20))  # mmapped, and (by default) raises the threshold to 8 MiB
held = libc.malloc(4 << 20)
print(json.dumps({"fixed": fixed, "mmapped": libc.mallinfo2().hblkhd}))
libc.free(held)
"""


def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallinfo2")
    except OSError:
        return False


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                         check=True)  # fmt: skip
    return json.loads(out.stdout)


@pytest.mark.skipif(not _has_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_a_block_below_a_freed_ones_size_is_mmapped_only_with_the_fixed_threshold():
    default, fixed = _probe("default"), _probe("fixed")
    assert default["mmapped"] < 4 << 20  # from the heap: kept there when freed
    assert fixed["fixed"] and fixed["mmapped"] >= 4 << 20  # its own mapping: unmapped on free


def test_threshold_out_of_range_is_refused():
    for bad in (0, 4095, (32 << 20) + 1):
        with pytest.raises(ValueError, match="threshold must be within"):
            jax_mlpo.return_freed_buffers(bad)
