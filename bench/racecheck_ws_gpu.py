"""The smallest Gluon warp-specialized kernels, to see what compute-sanitizer's racecheck says of Triton's own
warp-specialization protocol with none of our code around it (it reports RAW hazards on that protocol's shared-memory
bytes in ``paged_decode_sm90_kernel``, docs/kernels.md, "Paged decode on Hopper").

    compute-sanitizer --tool racecheck --racecheck-report all python bench/racecheck_ws_gpu.py
    python bench/racecheck_ws_gpu.py --sass     # no GPU needed: cross-compiles for sm90 and lists the protocol

The protocol (Triton's lowering of ``gl.warp_specialize``, NVIDIA backend): the worker warps (warps 4-7 here: the
one-warp partition and the two Triton pads it with to a whole warp group) wait at ``barrier.sync 1`` (all threads of the
block), read their state byte (``LDS.U8``, one a warp, at the end of the block's shared memory) and branch on it;
the four default warps store the state bytes and the captured values (``STS``), then pass the same barrier, and at
the end store the exit state before it. Each kernel here copies ``src`` to ``dst``: the default partition the first
half of each block's ``2 × BLOCK`` elements, a one-warp worker partition the second; the length is loaded by the
default warps, so it reaches the worker as a capture in shared memory, as the decode kernel's schedule does.
``ws_copy_kernel`` has nothing before ``gl.warp_specialize``; ``ws_copy_after_barrier_kernel`` first passes a
block barrier of the default warps (``bar.sync 0, 128``), as the decode kernel does after its mbarrier inits.

These kernels use shared memory for nothing else: a hazard racecheck reports here, between the protocol's stores and
loads that ``--sass`` lists with their offsets (a default thread writing, a worker thread reading), is one it reports
on Triton's protocol alone. Prints "ok" when ``dst`` equals ``src`` for both kernels.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from indexcache.backends.triton.sm90 import block_barrier

BLOCK = 128
PROTOCOL = ("BAR.SYNC", "LDS", "STS", "BRX", "EXIT")  # SASS opcodes of the protocol (and of the copies: none)


@gluon.jit
def _copy(src, dst, start, n, BLOCK: gl.constexpr, WARPS: gl.constexpr):
    """``dst[start + i] = src[start + i]`` for ``i < BLOCK`` below ``n``, over ``WARPS`` warps."""
    offs = start + gl.arange(0, BLOCK, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    gl.store(dst + offs, gl.load(src + offs, mask=offs < n), mask=offs < n)


@gluon.jit
def _split_copy(src, dst, n_ptr, BLOCK: gl.constexpr):
    n = gl.load(n_ptr)  # not rematerializable: the worker gets it through shared memory
    start = gl.program_id(0) * 2 * BLOCK
    gl.warp_specialize([(_copy, (src, dst, start, n, BLOCK, 4)), (_copy, (src, dst, start + BLOCK, n, BLOCK, 1))],
                       [1], [40])


@gluon.jit
def ws_copy_kernel(src, dst, n_ptr, BLOCK: gl.constexpr):
    _split_copy(src, dst, n_ptr, BLOCK)


@gluon.jit
def ws_copy_after_barrier_kernel(src, dst, n_ptr, BLOCK: gl.constexpr):
    block_barrier()
    _split_copy(src, dst, n_ptr, BLOCK)


KERNELS = (ws_copy_kernel, ws_copy_after_barrier_kernel)


def protocol_lines(cubin: bytes) -> list[str]:
    """The kernel's SASS lines (``/*offset*/ instruction``) with a barrier, a shared-memory access, an indexed branch
    or an exit (Triton's wheel's nvdisasm)."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([knobs.nvidia.nvdisasm.path, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    return [" ".join(line.split(";")[0].split()) for line in sass.splitlines()
            if line.lstrip().startswith("/*") and any(op in line for op in PROTOCOL)]


def cross_compiled(kernel) -> bytes:
    """``kernel``'s cubin for sm90, built here (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    source = GluonASTSource(kernel, {"src": "*fp32", "dst": "*fp32", "n_ptr": "*i32", "BLOCK": "constexpr"},
                            {"BLOCK": BLOCK}, {(i,): [["tt.divisibility", 16]] for i in range(3)})  # as a launch
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["cubin"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1000, help="elements copied (default 1000: 4 blocks, the last short)")
    parser.add_argument("--sass", action="store_true",
                        help="list each kernel's protocol instructions with their offsets (cross-compiled for sm90 "
                             "without a GPU, else the kernels that ran)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        if not args.sass:
            print("no GPU visible: run with --sass to cross-compile for sm90 and list the protocol")
            return 2
        for kernel in KERNELS:
            print(f"{kernel.__name__} (sm90, Triton {triton.__version__}):", *protocol_lines(cross_compiled(kernel)),
                  sep="\n  ")
        return 0
    src = torch.randn(args.n, device="cuda")
    n = torch.tensor([args.n], dtype=torch.int32, device="cuda")
    ok = True
    for kernel in KERNELS:
        dst = torch.zeros_like(src)
        compiled = kernel[(triton.cdiv(args.n, 2 * BLOCK),)](src, dst, n, BLOCK=BLOCK, num_warps=4)
        same = torch.equal(dst, src)
        ok &= same
        print(f"{kernel.__name__}: {'same' if same else 'DIFFERENT'}")
        if args.sass:
            print(*protocol_lines(compiled.asm["cubin"]), sep="\n  ")
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
