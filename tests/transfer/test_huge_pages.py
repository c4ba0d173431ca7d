"""Transparent huge pages for the host tier and vLLM's CPU KV cache: asked for, bytes kept.

What the kernel grants is read back from /proc/self/smaps: the advised region's VMA carries
the ``hg`` flag (MADV_HUGEPAGE), and after MADV_COLLAPSE its memory is in huge pages
(``AnonHugePages``) unless the kernel refused, which ``advise`` then reports."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest
import torch

from tests.helpers import aligned_inside, vma
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.huge_pages import HUGE_PAGE_BYTES, advise

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="madvise and /proc/self/smaps are Linux's")


def anon(nbytes: int) -> tuple[mmap.mmap, int]:
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()


def test_huge_pages_are_asked_for_on_the_whole_2mib_pages_of_a_region():
    mapping, ptr = anon(8 * HUGE_PAGE_BYTES)
    try:
        got = advise(ptr, 8 * HUGE_PAGE_BYTES, collapse=False)
        assert got.advised_bytes >= 7 * HUGE_PAGE_BYTES and got.advised_bytes % HUGE_PAGE_BYTES == 0
        assert got.hugepage_error == "" and got.collapse_error == "", got
        assert "hg" in vma(aligned_inside(ptr))["VmFlags"].split()
    finally:
        mapping.close()


def test_a_region_without_a_whole_2mib_page_is_left_alone():
    mapping, ptr = anon(HUGE_PAGE_BYTES)
    try:
        if ptr % HUGE_PAGE_BYTES == 0:  # a whole 2 MiB page after all: one byte less has none
            assert advise(ptr, HUGE_PAGE_BYTES - 4096, collapse=True).advised_bytes == 0
        else:
            assert advise(ptr, HUGE_PAGE_BYTES, collapse=True).advised_bytes == 0
        assert "hg" not in vma(ptr)["VmFlags"].split()
    finally:
        mapping.close()


def test_collapsing_memory_already_written_keeps_every_byte():
    """vLLM's KV cache is zeroed (faulted in 4 KiB pages) before tieredkv sees it: collapse
    rebuilds it in huge pages, with its contents."""
    mapping, ptr = anon(8 * HUGE_PAGE_BYTES)
    view = np.frombuffer(mapping, dtype=np.uint8)
    try:
        view[:] = np.random.default_rng(3).integers(0, 256, view.size, dtype=np.uint8)
        before = view.copy()
        got = advise(ptr, view.size, collapse=True)
        assert np.array_equal(view, before)
        if got.collapse_error:  # an older kernel, THP "never", or no huge page free
            pytest.skip(f"MADV_COLLAPSE refused here: {got.collapse_error}")
        assert int(vma(aligned_inside(ptr))["AnonHugePages"].split()[0]) > 0
    finally:
        del view
        mapping.close()


@pytest.mark.parametrize("huge", [True, False])
def test_a_pageable_pool_asks_for_huge_pages_only_when_told(huge):
    pool = HostPool(4, 4 * HUGE_PAGE_BYTES, pin=False, huge_pages=huge)
    addr = aligned_inside(pool.buffer.data_ptr())
    assert ("hg" in vma(addr)["VmFlags"].split()) is huge
    assert (pool.huge_pages is not None and pool.huge_pages.ok) is huge
    pool.buffer[:] = 7  # written after the advice: no byte lost either way
    assert int(pool.buffer.sum()) == 7 * pool.buffer.numel()
