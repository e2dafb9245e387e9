"""edgekv.export.pte_stepper.release_file_pages against the kernel's own accounting (/proc/self/smaps): the resident
pages of a mapped file are given back and the mapping still reads the same bytes."""
import mmap
import sys

import pytest
from conftest import mapped_rss as _resident

from edgekv.export.pte_stepper import release_file_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")


def test_resident_pages_of_a_mapped_file_are_given_back_and_still_read_the_same(tmp_path):
    path = tmp_path / "weights.bin"
    data = bytes(range(256)) * (4 * 4096)  # 4 MiB
    path.write_bytes(data)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert sum(m[i] for i in range(0, len(data), 4096)) == sum(data[i] for i in range(0, len(data), 4096))
        before = _resident(path.resolve())
        assert before >= len(data) - 4096  # every page was touched
        assert release_file_pages(path) == before
        assert _resident(path.resolve()) == 0
        assert m[12345] == data[12345] and m[len(data) - 1] == data[-1]  # faulted back in from the page cache
        assert release_file_pages(tmp_path / "not-mapped.bin") == 0


def test_after_a_sparse_release_a_read_brings_back_its_own_page_not_the_64_KiB_around_it(tmp_path):
    path = tmp_path / "table.bin"
    data = bytes(range(256)) * (4 * 4096)  # 4 MiB: 64 windows of 64 KiB (the kernel's fault-around)
    path.write_bytes(data)
    page, window = 4096, 64 * 1024
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        def read_one_byte_per_window():
            return sum(m[i + 100] for i in range(0, len(data), window))

        want = sum(data[i + 100] for i in range(0, len(data), window))
        assert read_one_byte_per_window() == want
        release_file_pages(path)  # plain: the pages stay in the page cache, and a read maps its neighbours too
        assert read_one_byte_per_window() == want
        around = _resident(path.resolve())
        assert release_file_pages(path, sparse=True) == around
        assert read_one_byte_per_window() == want  # the same bytes, now from storage page by page
        own = _resident(path.resolve())
        assert own <= 2 * (len(data) // window) * page  # a page per read (a second one at most)
        assert around >= 4 * own  # what fault-around mapped beside them (16 pages per read where the kernel does)
