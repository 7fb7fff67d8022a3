"""A memory tier segment cut short behind the store (truncated between its size check and
its mapping: the warmer thread met this beside a test that truncates segments) is a lost
segment, an OSError the put, read and warming paths handle, never mmap's ValueError
escaping a thread."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ucm_patch.hooks.stores.segment_files import MappedSegments, SegmentLost, segment_name

SEG = 64 << 10


def test_a_segment_shorter_than_a_segment_is_lost_not_a_value_error(tmp_path: Path) -> None:
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = os.open(segment_name(0), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
        os.ftruncate(fd, SEG // 4)  # cut short
        os.close(fd)
        files = MappedSegments(dir_fd, str(tmp_path), SEG, 0o600)
        with pytest.raises(SegmentLost, match="shorter than a segment"):
            files.fd(0, create=False)  # no allocation on this path: mapped as it is
        files.close()
    finally:
        os.close(dir_fd)
