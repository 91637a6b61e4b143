"""Weight bytes in 2 MB pages (kernels/ggml/pages.py): pieces aligned for ggml, the bytes kept,
chunks kept alive by their pieces, the kernel's THP mode read, and the loader's policy
(models/formats/ggml.py `keeps_huge_pages`)."""
from __future__ import annotations

import gc
import sys
from typing import Optional

import pytest
import torch

from kernels.env import reload as reload_env
from kernels.ggml import pages


def huge_bytes(tensors) -> Optional[int]:
    """Bytes the kernel backs with huge pages now in the mappings that `tensors` lie in (each
    mapping once: /proc/self/smaps AnonHugePages), or None where the file cannot be read."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
                    start, end = (int(x, 16) for x in head.split("-"))
                    inside = any(lo < end and hi > start for lo, hi in spans)
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return total


def test_pieces_hold_the_bytes_at_ggml_alignment_in_2mb_aligned_chunks():
    arena = pages.Arena(chunk=3 << 20)  # rounded up to 4 MB
    srcs = [torch.arange(n, dtype=torch.int16) for n in (7, 1001, 333_333)] + [torch.randn(5, 3).t()]
    pieces = [arena.copy(t) for t in srcs]
    for t, p in zip(srcs, pieces):
        assert p.dtype == torch.uint8 and p.data_ptr() % pages.ALIGN == 0
        assert torch.equal(p, t.contiguous().view(torch.uint8).reshape(-1))
    assert arena.chunk == 4 << 20 and arena.chunks == 1
    assert arena.bytes_held == sum(t.numel() * t.element_size() for t in srcs)
    assert pieces[0].data_ptr() % pages.HUGE == 0  # the first piece opens the chunk
    big = arena.empty(9 << 20)  # larger than a chunk: a chunk of its own
    assert arena.chunks == 2 and big.data_ptr() % pages.HUGE == 0 and big.numel() == 9 << 20


def test_without_huge_page_mappings_the_arena_holds_the_bytes_all_the_same(monkeypatch):
    """EDGEGEM_CPU_HUGEPAGES=on where mmap has no MADV_HUGEPAGE (macOS, Windows): plain memory."""
    monkeypatch.delattr(pages.mmap, "MADV_HUGEPAGE", raising=False)
    arena = pages.Arena()
    p = arena.copy(torch.arange(1000, dtype=torch.int32))
    assert p.data_ptr() % pages.HUGE == 0 and torch.equal(p.view(torch.int32), torch.arange(1000, dtype=torch.int32))


def test_a_piece_keeps_its_chunk_mapped_after_the_arena_goes():
    arena = pages.Arena()
    p = arena.copy(torch.full((4097,), 7, dtype=torch.uint8))
    del arena
    gc.collect()
    p[4096] = 9  # still mapped and writable
    assert int(p[:4096].sum()) == 7 * 4096 and int(p[4096]) == 9


def test_the_thp_mode_is_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    for text, mode in (("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                       ("always madvise [never]", "never"), ("garbage", "never")):
        f.write_text(text)
        assert pages.thp_mode(f) == mode
    assert pages.thp_mode(tmp_path / "missing") == "never"


@pytest.mark.skipif(not pages.available(), reason="no transparent huge pages here (THP never, or not Linux)")
def test_huge_bytes_reads_the_chunks_pages():
    """The kernel merges neighbouring marked mappings (an earlier model's chunks) into one, so the
    count is the whole mapping's: touching the chunk adds at most its own 8 MB of huge pages."""
    p = pages.Arena().empty(8 << 20)
    before = huge_bytes([p])
    p.fill_(1)  # touch every page: the kernel backs the marked range with 2 MB pages where it has them
    after = huge_bytes([p])
    assert before is not None and after is not None and after % pages.HUGE == 0
    assert 0 <= after - before <= 8 << 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/meminfo")
def test_available_bytes_is_memavailable():
    with open("/proc/meminfo") as f:
        want = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert abs(pages.available_bytes() - want) < 256 << 20  # moments apart


@pytest.mark.parametrize("setting,thp,want", [("auto", False, (False, False)), ("auto", True, (True, False)),
                                               ("on", False, (True, True)), ("off", True, (False, False))])
def test_huge_pages_are_used_where_they_are_given_and_the_copies_fit(setting, thp, want, monkeypatch):
    """auto: copied where the kernel gives huge pages and the copies take at most HUGE_SHARE of
    the memory available (not a 31B near the machine's memory); on/off force it (on: even without
    THP). want: (a small model, one of 60% of the memory)."""
    from models.formats import ggml as ggml_format

    monkeypatch.setattr(pages, "available", lambda: thp)
    monkeypatch.setenv("EDGEGEM_CPU_HUGEPAGES", setting)
    reload_env()
    assert (ggml_format.keeps_huge_pages(10, free_bytes=1000), ggml_format.keeps_huge_pages(600, free_bytes=1000)) == want
