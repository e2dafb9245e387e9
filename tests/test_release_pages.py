"""edgekv.export.runtime.release_file_pages against the kernel's own accounting (/proc/self/smaps): the resident
pages of a mapped file are given back and the mapping still reads the same bytes."""
import mmap
import re
import sys

import pytest

from edgekv.export.runtime import release_file_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")


def _resident(path) -> int:
    total, mine = 0, False
    for line in open("/proc/self/smaps"):
        head = re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$", line)
        if head:
            mine = head[1] == str(path)
        elif mine and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


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
