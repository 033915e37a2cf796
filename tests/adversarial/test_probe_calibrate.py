"""Issue 21 (adversarial probe), items 4 and 10: the calibration's overlap matrix needs memory by rows, layers and
k, not by index values, and every kind of corrupt dump is one named error (``DumpError``) naming the file, which
``indexcache calibrate`` prints as one line with exit status 2."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import indexcache
from indexcache.tools.calibrate.dump import load_dump
from indexcache.tools.calibrate.errors import DumpError
from indexcache.tools.calibrate.overlap import overlap_matrix
from indexcache.tools.cli import main

# The child of the item 4 test may use this much address space beyond what its imports took; the old
# calibration asked for 2 GiB (int32 index 2^31 - 1) and 1 TiB (int64 index 2^40) for a 3 x 32 x 8 dump.
HEADROOM = 1 << 30
OVERLAP_CHILD = textwrap.dedent(
    """
    import re, resource, sys, tracemalloc
    import numpy as np
    from indexcache.tools.calibrate.overlap import overlap_matrix

    top, dtype = int(sys.argv[1]), sys.argv[2]
    size = int(re.search(r"VmSize:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + int(sys.argv[3]), resource.RLIM_INFINITY))
    small = np.random.default_rng(0).integers(-1, 40, (3, 32, 8))  # layers, rows, k; -1 = empty slot
    large = np.where(small >= 0, top - small, -1).astype(dtype)  # the same sets under other (huge) names
    tracemalloc.start()
    got = overlap_matrix(list(large), threads=1)
    peak = tracemalloc.get_traced_memory()[1]
    np.testing.assert_allclose(got, overlap_matrix(list(small.astype(dtype)), threads=1), rtol=0, atol=1e-12)
    assert peak < 1 << 24, f"peak {peak} bytes"
    print("ok", peak)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the child limits itself with RLIMIT_AS and /proc")
@pytest.mark.parametrize(("top", "dtype"), [(2**31 - 1, "int32"), (2**40, "int64")])
def test_item4_overlap_memory_does_not_grow_with_index_values(top, dtype):
    """issue 21 item 4: a dump whose largest index is 2^31 - 1 (int32) or 2^40 (int64) gives the overlap of the
    same sets under small indices, in a process limited to 1 GiB beyond its imports and under 16 MiB traced."""
    root = str(Path(indexcache.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    child = subprocess.run(
        [sys.executable, "-c", OVERLAP_CHILD, str(top), dtype, str(HEADROOM)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert child.returncode == 0 and child.stdout.startswith("ok"), child.stderr[-2000:]


# ------------------------------------------------------------------------------------------- corrupt dumps


class _NotATensor:
    """A pickled object that torch.load(weights_only=True) refuses."""


def _good_bytes(suffix: str, directory: Path) -> bytes:
    scratch = directory / f"good{suffix}"
    indices = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    if suffix == ".pt":
        torch.save(indices, scratch)
    else:
        np.savez(scratch, indices.numpy())
    data = scratch.read_bytes()
    scratch.unlink()
    return data


CORRUPT: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "random-bytes": (
        "layer_0.pt",
        lambda path: path.write_bytes(np.random.default_rng(0).bytes(300)),
        r"torch\.load\(weights_only=True\) refused it",
    ),
    "truncated-zip-pt": (
        "layer_0.pt",
        lambda path: path.write_bytes(_good_bytes(".pt", path.parent)[:300]),
        r"not a readable torch\.save file \(RuntimeError: PytorchStreamReader failed reading zip archive",
    ),
    "truncated-zip-npz": (
        "layer_0.npz",
        lambda path: path.write_bytes(_good_bytes(".npz", path.parent)[:100]),
        r"not a readable \.npz archive \(BadZipFile",
    ),
    "empty-pt": ("layer_0.pt", lambda path: path.write_bytes(b""), r"empty file \(0 bytes\)"),
    "refused-pickle": (
        "layer_0.pt",
        lambda path: torch.save({"indices": torch.zeros(2, 3, dtype=torch.int32), "meta": _NotATensor()}, path),
        r"torch\.load\(weights_only=True\) refused it: corrupt, or it pickles objects other than tensors",
    ),
    "uint64-beyond-int64": (
        "layer_0.npz",
        lambda path: np.savez(path, np.array([[1, 2**64 - 1]], np.uint64)),
        r"uint64 value 18446744073709551615 is beyond int64",
    ),
    "k-zero": (
        "layer_0.pt",
        lambda path: torch.save(torch.zeros(2, 0, dtype=torch.int32), path),
        r"shape \(2, 0\); need at least one row and k >= 1",
    ),
}


def _corrupt_dump(tmp_path: Path, kind: str) -> tuple[Path, Path, str]:
    """A dump directory whose layer 0 is corrupt as ``kind`` says, and a good layer 1: (dir, bad file, fragment)."""
    name, write, fragment = CORRUPT[kind]
    dump = tmp_path / "dump"
    dump.mkdir()
    write(dump / name)
    np.savez(dump / "layer_1.npz", np.zeros((2, 3), np.int32))
    return dump, dump / name, fragment


@pytest.mark.parametrize("kind", list(CORRUPT))
def test_item10_corrupt_dump_is_one_named_error(tmp_path, kind):
    """issue 21 item 10: random bytes, a truncated zip (.pt and .npz), an empty .pt, a refused pickle, a uint64
    beyond int64 and k = 0 each raise DumpError (a ValueError) naming the file and what is wrong."""
    dump, bad, fragment = _corrupt_dump(tmp_path, kind)
    with pytest.raises(DumpError, match=fragment) as err:
        load_dump(dump)
    assert isinstance(err.value, ValueError)
    assert str(bad) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("kind", list(CORRUPT))
def test_item10_cli_prints_one_line_and_exits_2(tmp_path, capsys, kind):
    """issue 21 item 10: `indexcache calibrate --dump DIR` on each corrupt dump prints one error line naming the
    file, no traceback, and exits 2."""
    dump, bad, fragment = _corrupt_dump(tmp_path, kind)
    code = main(["calibrate", "--dump", str(dump), "--no-plots", "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert err.startswith(f"indexcache calibrate: error: {bad}: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(fragment, err), err


def test_item10_uint64_dump_that_fits_reads_as_int64(tmp_path):
    """issue 21 item 10: a uint64 dump whose values fit in int64 is read like the same dump in int64 (the format
    reads any integer dtype) instead of failing inside the overlap computation."""
    stack = np.random.default_rng(3).integers(0, 50, (3, 6, 4))
    for layer, indices in enumerate(stack):
        np.savez(tmp_path / f"layer_{layer}.npz", indices.astype(np.uint64))
    layers, arrays = load_dump(tmp_path)
    assert layers == [0, 1, 2]
    np.testing.assert_array_equal(overlap_matrix(arrays), overlap_matrix(list(stack)))
