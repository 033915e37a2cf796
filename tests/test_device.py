"""Device facts (indexcache.hal.device): how many blocks of a kernel an NVIDIA multiprocessor holds."""

import pytest

from indexcache.hal.device import resident_blocks

H200 = (65536, 228 * 1024, 2048)  # registers, shared bytes and threads a multiprocessor


@pytest.mark.parametrize(("registers", "shared", "threads", "blocks"), [
    (78, 33_824, 128, 6),  # the decode kernel at next_n 1 (ncu on the H200: block limit 6 by both)
    (112, 33_824, 128, 4),  # the same, uncapped under the persistent schedule (ncu: 4 by registers)
    (145, 33_824, 128, 3),  # next_n 2 (ncu: 3 by registers)
    (184, 43_520, 128, 2),  # next_n 2 uncapped (ncu: 2 by registers)
    (96, 146_872, 640, 1),  # DeepGEMM's decode kernel (ncu: 1 by registers and by shared memory)
    (32, 0, 1024, 2),  # by threads
    (16, 0, 32, 32),  # at most 32 blocks
])
def test_resident_blocks_as_ncu_counts_them(registers, shared, threads, blocks):
    assert resident_blocks(registers, shared, threads, H200) == blocks
