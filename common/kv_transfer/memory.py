"""Transparent huge pages for a pool the transports read and write in place.

On one host UCX moves a large message by having the kernel copy it between the two
processes (CMA), page by page; with 2 MiB pages instead of 4 KiB ones that copy ran
about twice as fast here (docs/kv-transfer.md §1). The pool is already written when a
transport gets it, so asking for huge pages (MADV_HUGEPAGE) is not enough: MADV_COLLAPSE
(Linux 6.1 and later) turns its pages into huge ones at once, keeping the contents.
"""
from __future__ import annotations

import ctypes
import os
import sys

import numpy as np

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def advise_huge_pages(array: np.ndarray) -> str:
    """Back the 2 MiB-aligned interior of `array`'s memory with huge pages where the
    kernel allows. Returns what happened, for the log: "collapsed", "advised" (huge pages
    from the next fault on only), or why not. Never raises; the contents do not change."""
    if not sys.platform.startswith("linux"):
        return f"not on {sys.platform}"
    start = -(-array.ctypes.data // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (array.ctypes.data + array.nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= start:
        return "smaller than a huge page"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(start, end - start, MADV_HUGEPAGE) != 0:
        return f"madvise(MADV_HUGEPAGE) failed: {os.strerror(ctypes.get_errno())}"
    if libc.madvise(start, end - start, MADV_COLLAPSE) != 0:
        return f"advised; MADV_COLLAPSE failed: {os.strerror(ctypes.get_errno())}"
    return "collapsed"
