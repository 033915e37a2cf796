"""Device facts (indexcache.hal.device): architecture names as numbers, the fp8-format rule."""

import pytest
import torch

from indexcache.hal.device import fp8_format, resident_blocks, sm_version


@pytest.mark.parametrize(("arch", "number"), [("sm80", 80), ("sm89", 89), ("sm90a", 90), ("sm100f", 100),
                                              ("sm120", 120)])
def test_sm_version_reads_every_suffix(arch, number):
    assert sm_version(arch) == number


@pytest.mark.parametrize("arch", ["gfx942", "sm", "90", "smx90"])
def test_sm_version_refuses_what_is_not_an_nvidia_arch(arch):
    with pytest.raises(ValueError, match=rf"arch: expected an NVIDIA architecture such as 'sm90', got '{arch}'"):
        sm_version(arch)


@pytest.mark.parametrize(("arch", "dtype"), [("gfx942", torch.float8_e4m3fnuz), ("gfx940", torch.float8_e4m3fnuz),
                                             ("gfx950", torch.float8_e4m3fn), ("sm90", torch.float8_e4m3fn),
                                             ("sm80", torch.float8_e4m3fn)])
def test_fp8_format_by_arch(arch, dtype):
    assert fp8_format(arch) is dtype


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
