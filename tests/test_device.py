"""Device facts (indexcache.hal.device): architecture names as numbers, the fp8-format rule."""

import pytest
import torch

from indexcache.hal.device import fp8_format, sm_version


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
