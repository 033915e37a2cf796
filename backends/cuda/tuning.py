"""NVIDIA tuning table: per op, the Triton block shapes and launch options, by architecture."""

from __future__ import annotations

from typing import Any

from indexcache.backends.cuda.arch import resolve
from indexcache.backends.triton.target import triton_release, usable_scaled_mma

# translate is memory-bound: 2K indices a program, 1K contiguous along k, 4 warps (16-byte accesses).
_COMMON: dict[str, dict[str, Any]] = {
    "translate": {"BLOCK_K": 1024, "ELEMS": 2048, "num_warps": 4},
    # Logits (the logits recipe of docs/kernels.md): keys on M, COLS = tokens × heads on N (2 tokens at H = 64),
    # warps along keys.
    # One warpgroup a program, three resident a SM (≤ 168 registers, 40 KB shared) so epilogues overlap MMAs.
    # KERNEL "tma-ws": the Hopper kernel in Gluon (prefill_sm90.py: one program a SM, a copy warp bringing 256 keys and
    # their scales a slot into a ring of TMA_STAGES slots, a power of two: H200, 2 and 4 within 1 %) where it takes the
    # call, else this Triton kernel;
    # TMA_MAXNREG the kernel-wide register cap (96 for the 20 warps), TMA_MATH_REGS the math groups' share. MXFP4
    # keys are widened once a call and take the fp8 kernels (prefill_fp4.py).
    "mqa_logits": {"KEYS_ON_M": True, "COLS": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3,
                   "PROGRAMS_PER_SM": 3, "KERNEL": "triton", "TMA_STAGES": 4, "TMA_MAXNREG": 96,
                   "TMA_MATH_REGS": 112},
    # Paged decode: 64-key tiles (one page: a scalar table entry, contiguous rows and scales)
    # through Triton's own pipeliner, 5 stages deep (H200: 74 / 90 % of copy at 64 × 32K / 128K; the register
    # prefetch variants PREFETCH 1-2 57-65 %), at most COLS dot columns (draft tokens × heads) a
    # program. A persistent grid of the programs that stay resident, counted from the compiled kernel (Triton 3.6,
    # sm90: 96 and 168 registers at next_n 1 and 2, five and three programs a SM; register caps that keep more
    # resident spill, or are slower when they do not: H200, docs/experiments.md); PROGRAMS_PER_SM only
    # where that count is not known (the interpreter).
    # KERNEL "tma-ws": the Hopper kernel in Gluon (decode_sm90.py: a copy warp brings pages TMA_STAGES ahead) where it
    # takes the call, else this Triton kernel; TMA_MAXNREG its kernel-wide register cap by draft tokens a program,
    # from which the copy warp's registers go to the math warps (64 / 80: four / three programs a SM), and
    # TMA_FP4_MAXNREG on an MXFP4 cache (64 / 80: four / three programs a SM, the copy warp at 24 registers; ptxas
    # keeps 8-16 bytes on the stack outside the tile loop at 64, three words a tile in it at 80, which the H200 ran
    # 5-6 % faster than 96 without them at next_n 2; 64 against 80 at next_n 1: 3-4 % faster, decode_sm90.py).
    # TMA_FP4_REG_A 1: the MXFP4 keys widened straight into the matmul's register operand (H200, 2026-12-05: 5-7 %
    # less time than through shared memory, docs/fp4.md). TMA_FP4_STAGES: the pages in flight on an MXFP4 cache (H100,
    # 2026-12-05, two runs: 2 against 4 took 0.981-0.984 of the time at 64 x 32K next_n 1, 0.988-0.994 at 128K, never
    # more; 3 between; 6 and 8 slower: docs/fp4.md). sm90 with Triton 3.6 takes it (below).
    "paged_mqa_logits": {"KEYS_ON_M": True, "COLS": 128, "BLOCK_KEYS": 64, "PROGRAMS_PER_SM": 2,
                         "PREFETCH": 0, "num_warps": 4, "num_stages": 5, "KERNEL": "triton", "TMA_STAGES": 4,
                         "TMA_MAXNREG": [64, 80], "TMA_FP4_MAXNREG": [64, 80], "TMA_FP4_REG_A": 1,
                         "TMA_FP4_STAGES": 2},
    "quantize_index_k": {"ELEMS": 4096, "num_warps": 4},  # also store_index_k: 4K values a program
    "gather_index_k": {"BLOCK_T": 32, "num_warps": 4},  # 32 tokens a block: 4 KB of fp8 keys at D = 128
    # HiSparse swap-in (hisparse/swap.py): 4 copies a step of a program over 2 warps (16-byte vectors), rows of up to
    # 2 KB in one tile, about 16 programs a SM spread over the plan's rows. On the H200 (b8ab289, 64 requests x 16 /
    # 64 / 256 misses of 656-byte rows, against a 55.4 GB/s contiguous copy): 0.661 / 0.805 / 0.840 of the link,
    # where 8 copies over 4 warps at 8 a SM gave 0.614 / 0.798 / 0.834; 256-byte tiles 0.580 / 0.722 / 0.750.
    # HOST_CACHE: the host reads' cache modifier ("" the default; ".cg" past L1, raced by bench/hisparse_swap_gpu.py
    # --race: on an H100, 2026-12-05, 1.07-1.11x the default's time at 16-256 misses a request).
    "hisparse_swap_in": {"BLOCK_C": 4, "CHUNK_BYTES": 2048, "PROGRAMS_PER_SM": 16, "num_warps": 2, "HOST_CACHE": ""},
    # HiSparse plan (hisparse/plan.py): one program a request over 16 warps, 4096 state slots a block (8 a thread:
    # 108 registers on sm90 with Triton 3.9; H200, 2026-12-03, the bench's drifting step: 26.9 µs against 29.5 at
    # 2048 a block, 30.2 over 32 warps), a row one block; 5-bit digits (32 bins, a lane each) in the eviction select;
    # 64 x 64 key pairs a step when ranking the slots taken; row_to_batch scanned 1024 at a time. maxnreg 128 (all
    # that 16 warps may have): without it ptxas for sm89 aimed at two programs a SM, 64 registers, and spilled 40
    # bytes at H 4096 with row_to_batch (Triton 3.9). Programmatic dependent launch where the GPU has it (below).
    # KEEP_KEYS: a state of one block keeps its eviction keys in registers for the pivot and the list of the slots
    # taken (H200, 2026-12-03, the bench's ring with a slot index: 15.75 µs a step against 16.28 reading them back).
    "hisparse_plan": {"BLOCK_H": 4096, "DIGIT": 5, "BLOCK_R": 1024, "BI": 64, "BJ": 64, "KEEP_KEYS": True,
                      "num_warps": 16, "maxnreg": 128},
    # Top-k (sampled threshold, then radix select over the candidates): 1K-value tiles over 4 warps, 256 coarse
    # bins for the fallback's row histogram, 5-bit digits (32 bins = one a lane: Triton 3.6 lowers a histogram by
    # ballots) in the selects, four resident programs a SM for the fused kernel (maxnreg 128). Rows split into
    # chunks of >= 4K columns (powers of two), about 8 a SM, when rows are few: the sample over 8 warps, the filter
    # a lane a thread over 8 warps packing every 8 steps (77 registers, three programs a SM), 2048 candidate bins;
    # the finish (one program an SM, persistent): 2K tiles over 8 warps, up to 224 registers (ptxas capped itself at
    # 128 and spilled), reading up to 64 chunks side by side. SAMPLE_RANK 32: about 32 sample entries expected above
    # the k-th best (H200: 16 left more candidates, 64 sampled longer than it saved). A stash of
    # max(4096, 4k, columns / 32) entries a row. A split row whose pivot bin holds at most FINISH_TIES candidates is
    # finished by a program a chunk (its candidates above the bin; the first also ranks the bin's). sorted=True: a
    # row's keys sorted over one warp per SORT_PER_WARP keys (8 int64 a thread: 2048 keys on 8 warps; from the
    # cross-compiled register counts, not measured).
    # KERNEL "block": the Gluon kernel of topk/block.py (a block of BLOCK_WARPS warps a row, BLOCK_PIECE_J columns a
    # thread a piece, one program a SM) takes rows of up to BLOCK_MAX_COLS columns: the many-rows calls, and from
    # BLOCK_MIN_ROWS rows on those that would be split (H200: 32-36 % less time than the Triton path on 64 decode rows,
    # 26 % on 2048 prefill rows; one row of 128K stays split: 50 µs against 29); rows of 1M columns it finished 1.8-3.5x
    # slower than the fused Triton kernel (480 to 2048 rows, 2026-12-02). 32 warps: 11-25 % faster than 16
    # (2-11 % with the radix select before); 4 columns a thread a piece: 8 were 2-5 % faster on decode rows and 3 %
    # slower on prefill, and leave a stack frame with Triton 3.9 at 32 warps. From BLOCK_SAMPLE_ROWS rows on, the rows
    # are sampled ahead by a launch of their own and the block kernel reads each row's threshold and first bins'
    # shift (BLOCK_FLOORS 1: the candidates' bins counted after the filter; 2: by the filter; H200, 4096 rows of 32K:
    # 719-721 µs against 764-767 sampling in the block). BLOCK_PREFETCH: a program's next row into L2 while a row is
    # selected, on rows sampled in the block only (764 against 780 µs there; 744 against 719 on rows sampled ahead).
    # SAMPLE_ROUNDS: the sample launch's radix rounds, at most (0: until the m-th best sample key is settled; 3 as the
    # block kernel's own sample: on the prefill producer's 4096 x 32K logits, replayed on the CPU, 3.66 rounds a row
    # on average become 2.97 for 1 % more candidates). AHEAD_SAMPLE_RANK: the sample launch's entries a row sampled
    # ahead at that SAMPLE_RANK (0: the block kernel's own sample, at least one a thread: 1024 at 32K, where rank 32
    # takes 512; replayed on the CPU, 17 % more candidates). AHEAD_SAMPLE_WARPS: that launch's warps (0: SAMPLE_WARPS,
    # which the split rows' sample of up to SAMPLE entries keeps; with Triton 3.6 a 1024-entry sample takes 31 / 40 /
    # 71 / 96 registers over 8 / 4 / 2 / 1 warps). Rank 32: the top-k of rows sampled ahead 4-7 % faster in four races
    # on an H100 and an H200 (the sample launch a third shorter, the block kernel a little longer over its candidates;
    # H200, 2026-12-06: 4096 causal rows of 32K 0.959x, 512 x 32K 0.930x), the whole prefill producer step 0.6-1.3 %
    # faster at 4096 x 32K and level at 8192 x 128K (docs/kernels.md, "On the H200, and rank 32 in the table"); the
    # rounds cap and fewer warps within 0.6 % of none (docs/kernels.md, "Rows sampled ahead"). BLOCK_SMEM: the block
    # kernel's bin counts, warp counts and pivot bin (1), and the stash's keys too (2), in shared memory (declared in
    # inline PTX) instead of the workspace, so a row's select waits on fewer L2 round trips (docs/kernels.md, "The
    # select in shared memory"; raced on an H100 there: 1).
    "topk": {"TILE": 1024, "BITS": 8, "DIGIT": 5, "num_warps": 4, "maxnreg": 128, "PROGRAMS_PER_SM": 4,
             "CHUNKS_PER_SM": 8, "SAMPLE_WARPS": 8, "FILTER_WARPS": 8, "FILTER_PACK": 8, "FINISH_TILE": 2048,
             "FINISH_WARPS": 8, "FINISH_MAXNREG": 224, "GATHER_CHUNKS": 64, "FINISH_BINS": 2048, "FINISH_TIES": 256,
             "MIN_CHUNK": 4096, "SAMPLE": 4096, "SAMPLE_RANK": 32, "STASH": 4096, "STASH_PER_K": 4,
             "STASH_COLS_SHIFT": 5, "SORT_PER_WARP": 256, "KERNEL": "block", "BLOCK_WARPS": 32, "BLOCK_PIECE_J": 4,
             "BLOCK_PER_SM": 1, "BLOCK_MIN_ROWS": 32, "BLOCK_MAX_COLS": 262144,
             "BLOCK_SAMPLE_ROWS": 256, "BLOCK_FLOORS": 2, "BLOCK_PREFETCH": 1, "SAMPLE_ROUNDS": 0,
             "AHEAD_SAMPLE_RANK": 32, "AHEAD_SAMPLE_WARPS": 0, "BLOCK_SMEM": 1},
}


_PREFILL_SHARED = 42 * 1024  # an fp8 prefill program's shared memory at 3 stages (sm90, sm100; 34 KB on sm89, sm120)


def _triton_before(major: int, minor: int) -> bool:
    found = triton_release()
    return found is not None and found < (major, minor)


def tuning(arch: str) -> dict[str, dict[str, Any]]:
    """The table for an NVIDIA architecture ("sm80", "sm90", …): the common entries with the choices that depend
    on its record (``arch.py``), and that record's capabilities under "arch" (shown by ``indexcache info``)."""
    record = resolve(arch)
    caps = record.capabilities(arch)
    table = {op: dict(cfg) for op, cfg in _COMMON.items()}
    # fp8 logits: the fp8 dot where there are fp8 matrix instructions; before sm89 (A100) the kernels read the
    # fp8 cache as bytes and decode e4m3 to fp16 in registers before an fp16 mma.sync (exact), and quantize /
    # store build the e4m3 bytes with bit arithmetic (no fp8 conversion instructions either).
    fp8 = caps["fp8_mma"]
    table["mqa_logits"]["FP8_DOT"] = table["paged_mqa_logits"]["FP8_DOT"] = "fp8" if fp8 else "fp16"
    table["quantize_index_k"]["FP8_CVT"] = "native" if fp8 else "bits"
    # Resident prefill programs a SM: as many as shared memory holds, at most the three of the Hopper recipe; two
    # with the fp16 decode (about 250 registers a thread: the register file holds two 128-thread programs).
    per_sm = 3 if fp8 else 2
    table["mqa_logits"]["PROGRAMS_PER_SM"] = max(1, min(per_sm, caps["shared_per_sm"] // _PREFILL_SHARED))
    if not fp8:
        # Decode with the fp16 decoding of fp8 keys: one draft token a program (Triton 3.9 spills 144 bytes at two).
        table["paged_mqa_logits"]["COLS"] = 64
        # The HiSparse plan (no fp8 in it, but ptxas for sm80 allocates otherwise): 16 warps over 2048-slot blocks
        # spill 8-24 bytes (Triton 3.9); 8 warps over 1024-slot blocks take 104-128 registers and spill nothing.
        table["hisparse_plan"].update(BLOCK_H=1024, num_warps=8)
    if caps["mma"] == "mma.sync":
        # The MXFP4 decode before Hopper: without a register cap ptxas aims at three programs a SM (168 registers)
        # and spills 16-24 bytes of the widening's; with 255 it takes 155-219 and spills nothing (Triton 3.9). So does
        # the prefill's far keys' exact path (prefill_fp4.py: 24 bytes at 168 on sm89).
        table["paged_mqa_logits"]["FP4_MAXNREG"] = table["mqa_logits"]["FP4_MAXNREG"] = 255
        # Ragged rows one a program: two (RAGGED_PAIRS, elsewhere) spill 24 bytes on sm120 at 168 registers.
        table["paged_mqa_logits"]["RAGGED_PAIRS"] = False
    if (scaled := usable_scaled_mma(record)) is not None and scaled.rows > 64:
        # MXFP4 logits on sm100's block-scaled MMA: its 128-key tiles over 8 warps, the decode's register cap 255
        # (Triton 3.9: over 4 warps the tile's accumulator, queries and key bytes left 224-288-byte stack frames at 255
        # registers; over 8 warps ptxas capped the next_n 1 decode at 128 and spilled 16 bytes).
        table["mqa_logits"]["FP4_NUM_WARPS"] = table["paged_mqa_logits"]["FP4_NUM_WARPS"] = 8
        table["paged_mqa_logits"]["FP4_MAXNREG"] = 255
    # The top-k's block kernel and finishing launch, and the Hopper decode, start with programmatic dependent launch
    # where there is one: their programs take the multiprocessors the launch before them leaves and wait there for its
    # end, in place of a launch gap each (docs/kernels.md, "The producer step of decode").
    table["topk"]["PDL"] = table["paged_mqa_logits"]["PDL"] = caps["pdl"]
    # The HiSparse plan too (H200, 2026-12-03, the bench's ring of plans: 25.9 µs a step against 26.9 without); not
    # the swap-in (33.8 against 33.8: its misses' bytes, not the launch, bound it).
    table["hisparse_plan"]["PDL"] = caps["pdl"]
    if caps["mma"] == "wgmma" and _triton_before(3, 7):
        # Decode, measured on the H200 with Triton 3.6 (docs/experiments.md): the warp-specialized Gluon
        # kernel is 3-10 % faster than the Triton one on every decode row of the peer comparison and gives the same
        # logits bit for bit. Later Triton versions build it but are unmeasured.
        table["paged_mqa_logits"]["KERNEL"] = "tma-ws"
        # Prefill, measured on the H200 with Triton 3.6 (a sweep): 4 tokens a program (256
        # dot columns), two resident a SM reach 68.5 % of the fp8 matmul rate against 60-65 % for 2 tokens and three.
        # Triton 3.7+ keeps Q in shared memory differently and spills at 256 columns, so it keeps 128. The Gluon
        # kernel is 3-6 % faster than that one (BENCHMARKS.md); Triton 3.9 builds it with a 16-24-byte stack frame
        # (values hoisted above the warp groups' partitions; prefill_sm90.STACK_BYTES allows 8), so later versions keep
        # the Triton kernel.
        table["mqa_logits"].update(COLS=256, PROGRAMS_PER_SM=2, KERNEL="tma-ws")
    if caps["mma"] == "wgmma":
        # overlap(tokens=, context=): measured on the H200 (bench/overlap_gpu.py, docs/streams.md): the producer's
        # indexer beside a V3.2 layer's main-stream work, captured in a graph. From 32 to 256 tokens over at least 32K
        # keys, the side on an SM partition of 0.485 of the SMs (64 of 132; a green context, the main keeping the whole
        # device) was the best share or level with none: 0.858x in order at 64 x 128K against 0.938x with no share,
        # 0.887x against 0.919x at 64 x 32K, 0.847x against 0.888x at 32 x 128K, 0.889x against 0.905x for a 256-token
        # chunk (2026-12-04); partitions of 33 to 99 SMs did no better. Below 32 tokens or 32K keys a partition was
        # level or up to 1.5 % slower (8 x 32K), and a 1024-token chunk lost on every one (1.04x against 0.97x): no
        # share up to 4K tokens. Past that (unmeasured; the gain shrank to 0.96-0.98x at 4K): in order. An SM budget
        # without a partition was slower than none everywhere (our kernels at one program a SM lose 5-80 % of their
        # speed; torch's default matmuls ignore the carveout), so where there are no partitions the rule's share
        # overlaps with no budget. Eagerly the one host thread launches both functions' kernels in turn and
        # overlapping was 1.02-1.3x in order: in order.
        # MXFP4 keys (overlap(k_format=torch.float4_e2m1fn_x2), DeepSeek-V4's), measured on the H200 (2026-12-05,
        # 799fc48, bench/overlap_gpu.py --keys mxfp4, decode): at 64 x 128K the side on 79 SMs (0.6) hid 42 % of the
        # indexer (the step 0.809x in order) against 19 % on 64 (0.915x): its decode takes longer there (388 us) and
        # wants more of the GPU; at 64 x 32K 64 SMs stayed the best (58 % hidden; 52-53 % on 44 or 79). Elsewhere
        # unmeasured with MXFP4: as fp8.
        # On an H100 (80 GB HBM3, 3.35 TB/s against the H200's 4.8; 2026-12-06, bec827e, two runs of
        # bench/overlap_gpu.py agreeing within 0.8 %, graphs): the side wants a third of the SMs (44): at 64 x 128K the
        # step took 0.860x in order on 44 against 0.895x on 64 and 0.948x with no share, at 64 x 32K 0.897x against
        # 0.908x, and with one to 31 requests over 128K keys 0.870-0.877x against 0.905-0.911x with no share (8
        # requests; one request 0.874-0.877x against 0.880-0.882x); below 128K keys up to 31 requests, and prefill
        # chunks, as the H200. With MXFP4 keys 64 x 128K still wants 0.6 (79 SMs: 0.853x against 0.920x on 64, 1.100x on
        # 44) and 64 x 32K took 0.884x on 44 against 0.888x on 64; below 32 requests unmeasured: no share.
        table["overlap"] = {"GRAPH": ((31, 0, None), (256, 32768, 0.485), (4096, 0, None)), "EAGER": (),
                            "GRAPH_MXFP4": ((31, 0, None), (256, 131072, 0.6), (256, 32768, 0.485), (4096, 0, None)),
                            "DEVICES": (("H100", {
                                "GRAPH": ((31, 131072, 0.33), (31, 0, None), (256, 32768, 0.33), (4096, 0, None)),
                                "GRAPH_MXFP4": ((31, 0, None), (256, 131072, 0.6), (256, 32768, 0.33),
                                                (4096, 0, None))}),)}
    return {**table, "arch": caps}
