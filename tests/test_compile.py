"""The ops as ``torch.library`` custom ops (issue 16): ``torch.library.opcheck`` on every op, every op inside one
``torch.compile(fullgraph=True)`` equal to eager, the backend chosen at run time under compile, and the small
model compiled. CPU, torch backend."""

from __future__ import annotations

import os

import pytest
import torch

import indexcache
from indexcache.hal import budget, dispatch, library
from indexcache.hal.checks import MAX_TOPK
from indexcache.hal.dispatch import BackendNotSupportedError
from indexcache.hal.layout import new_packed_cache
from indexcache.hal.specs import SPECS

pytestmark = pytest.mark.usefixtures("one_thread")

I32 = torch.int32
E4M3 = torch.float8_e4m3fn


def _cases(op: str, n: int = 2):
    picked = list(SPECS[op].cases[:n])
    if op == "mqa_logits":  # a bf16 case too: opcheck's test_schema can run on it (see test_opcheck)
        picked.append(next(c for c in SPECS[op].cases if "bf16" in c.name))
    picked += [c for c in SPECS[op].cases if c.name.startswith("MXFP4")][:1]  # float4 and e8m0 through the op
    picked += [c for c in SPECS[op].cases if c.name.startswith("MXFP4 queries")][:1]  # and q_scale
    picked += [c for c in SPECS[op].cases if "group's four layers" in c.name]  # Tensor[] arguments
    for case in picked:
        gen = torch.Generator().manual_seed(0)
        args = case.build(gen, "cpu", E4M3) if case.native_fp8 else case.build(gen, "cpu")
        yield pytest.param(op, args, id=f"{op}: {case.name}")


def test_every_op_is_registered():
    assert set(library.OPS) == set(SPECS)
    for op in SPECS:
        assert getattr(torch.ops.indexcache, op).default is library.OPS[op]
        assert [a.name for a in library.OPS[op]._schema.arguments] == list(library.ARGS[op])
    assert library.mutated("store_index_k") == ("k_cache",)
    assert library.mutated("paged_mqa_logits") == ("out",)  # it only reads its cache
    assert library.mutated("topk") == ("out", "workspace")
    assert library.mutated("topk_translate") == ("out", "out_raw", "workspace")
    assert library.mutated("paged_topk_translate") == ("logits", "out", "out_raw", "workspace")


@pytest.mark.parametrize(("op", "args"), [p for op in SPECS for p in _cases(op)])
def test_opcheck(op, args):
    kwargs = SPECS[op].check(**args)
    for name in library.mutated(op):
        if kwargs[name] is not None and name != "k_cache":
            for t in [kwargs[name]] if isinstance(kwargs[name], torch.Tensor) else kwargs[name]:
                t.zero_()
    fp8 = any(isinstance(t, torch.Tensor) and t.dtype.itemsize == 1 and t.dtype.is_floating_point
              for t in kwargs.values())
    # opcheck's test_schema compares the inputs before and after with torch.allclose, which fp8 tensors do not
    # implement on the CPU; the other three checks (autograd registration, fake tensor, AOT dispatch with dynamic
    # shapes) run on every case, test_schema on the cases without fp8 inputs.
    utils = [u for u in ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
             if not (fp8 and u == "test_schema")]
    torch.library.opcheck(library.OPS[op], tuple(library.op_arguments(op, kwargs, "torch")), test_utils=utils)


def _checked_args(op: str) -> dict:
    """The custom op's arguments (``backend`` "torch", no SM budget, no e8m0 views) for ``op``'s first conformance
    case, outputs allocated."""
    case = SPECS[op].cases[0]
    gen = torch.Generator().manual_seed(0)
    args = SPECS[op].check(**(case.build(gen, "cpu", E4M3) if case.native_fp8 else case.build(gen, "cpu")))
    return dict(args, backend="torch", **({"sm_budget": None} if op in library.BUDGETED_OPS else {}), e8m0=[])


def _i32(*shape):
    return torch.zeros(shape, dtype=I32)


# Per op, arguments the spec check refuses on metadata alone: (op, what is wrong, the changed arguments).
BAD_METADATA = [
    ("quantize_index_k", "block 0", lambda a: dict(block=0)),
    ("quantize_index_k", "D 100, block 64", lambda a: dict(k=torch.randn(4, 100), block=64)),
    ("quantize_index_k", "block -1", lambda a: dict(block=-1)),
    ("quantize_index_k", "not an fp8 format", lambda a: dict(fp8_dtype=torch.float16)),
    ("quantize_index_k", "int32 keys", lambda a: dict(k=_i32(4, 128))),
    ("translate", "page_size 0", lambda a: dict(page_size=0)),
    ("translate", "int64 raw", lambda a: dict(raw=a["raw"].long())),
    ("translate", "seq_lens of another row count", lambda a: dict(seq_lens=_i32(3))),
    ("translate", "out of another shape", lambda a: dict(out=_i32(1, 5))),
    ("translate", "out an expanded view", lambda a: dict(out=_i32(1, 1).expand(1, 4))),
    ("topk", "k -1", lambda a: dict(k=-1)),
    ("topk", "k past MAX_TOPK", lambda a: dict(k=MAX_TOPK + 1)),
    ("topk", "lengths of another row count", lambda a: dict(lengths=_i32(5))),
    ("topk", "int64 out", lambda a: dict(out=a["out"].long())),
    ("topk_translate", "page_size 0", lambda a: dict(page_size=0)),
    ("topk_translate", "out_raw of another shape", lambda a: dict(out_raw=_i32(8, 127))),
    ("topk_translate", "int64 page_table", lambda a: dict(page_table=a["page_table"].long())),
    ("mqa_logits", "k of another dim", lambda a: dict(k=a["k"][:, :64])),
    ("mqa_logits", "weights of another shape", lambda a: dict(weights=a["weights"][:, :8])),
    ("mqa_logits", "out of another shape", lambda a: dict(out=a["out"][:, :7])),
    ("paged_mqa_logits", "max_context_len -1", lambda a: dict(max_context_len=-1)),
    ("paged_mqa_logits", "an int32 cache", lambda a: dict(k_cache=a["k_cache"].int())),
    ("paged_mqa_logits", "a cache starting off a 4-byte boundary",
     lambda a: dict(k_cache=torch.zeros(a["k_cache"].numel() + 1, dtype=torch.uint8)[1:].view(a["k_cache"].shape))),
    ("paged_mqa_logits", "context_lens of another batch", lambda a: dict(context_lens=_i32(4))),
    ("paged_mqa_logits", "an fp8 cache read as MXFP4", lambda a: dict(k_format=torch.float4_e2m1fn_x2)),
    ("paged_topk_translate", "k_format bfloat16", lambda a: dict(k_format=torch.bfloat16)),
    ("paged_topk_translate", "k -1", lambda a: dict(k=-1)),
    ("paged_topk_translate", "page_size 0", lambda a: dict(page_size=0)),
    ("paged_topk_translate", "out_raw of another shape", lambda a: dict(out_raw=_i32(3, 63))),
    ("paged_topk_translate", "logits of another width", lambda a: dict(logits=a["logits"][:, :10])),
    ("mqa_topk_translate", "topk -1", lambda a: dict(topk=-1)),
    ("mqa_topk_translate", "ke of another length", lambda a: dict(ke=_i32(5))),
    ("mqa_topk_translate", "row_to_batch of another length", lambda a: dict(row_to_batch=_i32(5))),
    ("mqa_topk_translate", "out_raw of another shape", lambda a: dict(out_raw=_i32(3, 63))),
    ("mqa_topk_translate", "workspace_bytes 0", lambda a: dict(workspace_bytes=0)),
    ("store_index_k", "slot_mapping of another length", lambda a: dict(slot_mapping=_i32(7))),
    ("store_index_k", "keys of dim 6", lambda a: dict(k=torch.randn(8, 6))),
    ("store_index_k", "not an fp8 format", lambda a: dict(fp8_dtype=torch.bfloat16)),
    ("gather_index_k", "dim 0", lambda a: dict(dim=0)),
    ("gather_index_k", "block_table of another batch", lambda a: dict(block_table=_i32(7, 5))),
    ("gather_index_k", "out_k of another width", lambda a: dict(out_k=a["out_k"][:, :64])),
    ("gather_index_k", "float64 out_scale", lambda a: dict(out_scale=a["out_scale"].double())),
    ("hisparse_plan", "int64 raw", lambda a: dict(raw=a["raw"].long())),
    ("hisparse_plan", "slot_age of another shape", lambda a: dict(slot_age=_i32(5, 63))),
    ("hisparse_plan", "host_rows -1", lambda a: dict(host_rows=-1)),
    ("hisparse_plan", "int32 out_copy_src", lambda a: dict(out_copy_src=a["out_copy_src"].int())),
    ("hisparse_plan", "a slot index narrower than H + max(L, H)",
     lambda a: dict(slot_index=_i32(a["slot_token"].shape[0], 1))),
    ("hisparse_swap_in", "int32 copy_src", lambda a: dict(copy_src=a["copy_src"].int())),
    ("hisparse_swap_in", "host_kv of another row width", lambda a: dict(host_kv=a["host_kv"][:, :100])),
    ("hisparse_swap_in", "float device_loc", lambda a: dict(device_loc=a["device_loc"].float())),
    ("hisparse_swap_in", "two host layers for one device layer", lambda a: dict(host_kv=[a["host_kv"]] * 2)),
    ("hisparse_swap_in", "a group's second layer of another row width",
     lambda a: dict(host_kv=[a["host_kv"], a["host_kv"][:, :100]], device_kv=[a["device_kv"], a["device_kv"]])),
]


def test_the_bad_metadata_table_covers_every_op():
    assert {op for op, _, _ in BAD_METADATA} == set(SPECS)


@pytest.mark.parametrize(("op", "change"), [pytest.param(op, change, id=f"{op}: {what}")
                                            for op, what, change in BAD_METADATA])
def test_fake_implementations_refuse_what_the_real_op_refuses(op, change):
    """Under FakeTensorMode (AOT tracing, torch.export) each custom op runs its spec check: the same error as the
    real op, where before the fake implementation checked nothing (block 0 raised ZeroDivisionError, D 100 with
    block 64 got a shape the real op refuses)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _checked_args(op)
    args.update(change(args))
    values = [*library.op_values(op, args), *(args[n] for n in library.ARGS[op][len(library.PARAMS[op]):])]
    with pytest.raises((TypeError, ValueError)) as real:
        library.OPS[op](*values)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else
                 [mode.from_tensor(t) for t in v] if isinstance(v, list) else v for v in values]
        with pytest.raises(type(real.value)) as fake:
            library.OPS[op](*fakes)
    assert str(fake.value) == str(real.value)


@pytest.mark.parametrize(("op", "change"), [pytest.param(op, change, id=f"{op}: {what}")
                                            for op, what, change in BAD_METADATA])
def test_errors_under_fullgraph_and_dynamic_shapes_give_the_eager_message(op, change):
    """With dynamic shapes the sizes, strides and int arguments are symbolic while Dynamo traces the check, and Dynamo
    cannot format a symbolic int: with fullgraph, 34 of these refusals reported "Failed to trace builtin operator" or
    "BUILD_STRING type error" without the check's message. Now Dynamo's report holds the eager message, values and
    all."""
    case = SPECS[op].cases[0]
    gen = torch.Generator().manual_seed(0)
    args = case.build(gen, "cpu", E4M3) if case.native_fp8 else case.build(gen, "cpu")
    args.update(change(dict(args, **SPECS[op].check(**args))))
    public = getattr(indexcache, op)
    with pytest.raises((TypeError, ValueError)) as eager:
        public(**args)
    # The tensors and the ints are the compiled function's arguments (symbolic with dynamic=True), the rest constants.
    traced = {n: v for n, v in args.items() if isinstance(v, (torch.Tensor, list, int)) and not isinstance(v, bool)}
    constants = {n: v for n, v in args.items() if n not in traced}
    torch._dynamo.reset()
    compiled = torch.compile(lambda **kw: public(**kw, **constants), fullgraph=True, backend="eager", dynamic=True)
    with pytest.raises(Exception) as got:  # Dynamo's Unsupported, or the op's own error where the real op checks
        compiled(**traced)
    assert str(eager.value) in str(got.value)


def test_a_float_for_an_int_gives_the_eager_message_under_fullgraph_and_dynamic_shapes():
    """A float is symbolic too while Dynamo traces with dynamic=True: refusing ``k=2.0`` reported "BUILD_STRING type
    error" in place of the message."""
    scores, lengths, k = torch.randn(2, 8), torch.tensor([8, 3], dtype=I32), 2.0
    with pytest.raises(TypeError, match="^k: expected an int, got ") as eager:
        indexcache.topk(scores, lengths, k)
    torch._dynamo.reset()
    compiled = torch.compile(indexcache.topk, fullgraph=True, backend="eager", dynamic=True)
    with pytest.raises(Exception, match="raised exception") as got:
        compiled(scores, lengths, k)
    assert str(eager.value) in str(got.value)


def _inputs():
    g = torch.Generator().manual_seed(0)
    rows, n, k, page, dim, heads = 4, 40, 8, 8, 32, 2
    keys = torch.randn(n, dim, generator=g)
    return dict(
        keys=keys,
        cache=new_packed_cache(num_pages=n // page, page_size=page, dim=dim),
        slots=torch.randperm(n, generator=g).to(I32),
        q=torch.randn(rows, heads, dim, generator=g),
        weights=torch.rand(rows, heads, generator=g),
        lens=torch.tensor([40, 33, 7, 0], dtype=I32),
        table=torch.randperm(n // page, generator=g).to(I32).repeat(rows, 1),
        ks=torch.zeros(rows, dtype=I32),
        ke=torch.tensor([40, 20, 5, 0], dtype=I32),
        k=k,
        page=page,
    )


def every_op(keys, cache, slots, q, weights, lens, table, ks, ke, k, page, backend=None):
    """Every op but gather_index_k (tested on its own below) and the HiSparse two in one function, each feeding the
    next."""
    dim = keys.shape[1]
    k8, scale = indexcache.quantize_index_k(keys, E4M3, block=dim, backend=backend)
    indexcache.store_index_k(keys, cache, slots, E4M3, backend=backend)
    q8, _ = indexcache.quantize_index_k(q.reshape(-1, dim), E4M3, block=dim, backend=backend)
    q8 = q8.view(q.shape)
    prefill = indexcache.mqa_logits(q8, k8, scale[:, 0].contiguous(), weights, ks, ke, backend=backend)
    decode = indexcache.paged_mqa_logits(q8[:, None], cache, weights, lens, table, keys.shape[0], backend=backend)
    step = indexcache.paged_topk_translate(q8[:, None], cache, weights, lens, table, keys.shape[0], k, table, page,
                                           backend=backend).sort(1).values  # the order of an unsorted top-k is free
    raw = indexcache.topk(decode, lens, k, sorted=True, backend=backend)
    slots_out = indexcache.translate(raw, table, lens, page, backend=backend)
    out_raw = torch.empty_like(raw)
    fused = indexcache.topk_translate(prefill, ke, k, table, page, out_raw=out_raw, sorted=True, backend=backend)
    # A bound of 64 KiB: on the torch backend many rows a pass, on the cuda one enough for its top-k's workspace too.
    produced = indexcache.mqa_topk_translate(q8, k8, scale[:, 0].contiguous(), weights, ks, ke, k, table, page,
                                             workspace_bytes=1 << 16, backend=backend).sort(1).values
    return k8.view(torch.uint8), scale, cache, prefill, decode, step, raw, slots_out, fused, out_raw, produced


def _equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", [None, "torch"])
def test_every_op_compiles_with_fullgraph_and_equals_eager(backend):
    torch._dynamo.reset()
    want = every_op(**_inputs(), backend=backend)
    compiled = torch.compile(every_op, fullgraph=True, backend="aot_eager")
    got = compiled(**_inputs(), backend=backend)
    _equal(got, want)


def test_mxfp4_queries_compile_with_fullgraph_and_equal_eager():
    """``q_scale`` (MXFP4 queries) travels through the custom op: the compiled prefill logits equal the eager ones."""
    torch._dynamo.reset()
    fp4 = torch.float4_e2m1fn_x2
    g = torch.Generator().manual_seed(0)
    q, q_scale = indexcache.quantize_index_k(torch.randn(8, 128, generator=g), fp4)
    k, k_scale = indexcache.quantize_index_k(torch.randn(30, 128, generator=g), fp4)
    args = (q.view(2, 4, 64), k, k_scale, torch.randn(2, 4, generator=g), torch.zeros(2, dtype=I32),
            torch.tensor([30, 9], dtype=I32))

    def f(q, k, k_scale, weights, ks, ke, q_scale):
        return indexcache.mqa_logits(q, k, k_scale, weights, ks, ke, q_scale=q_scale)

    want = f(*args, q_scale.view(2, 4, 4))
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*args, q_scale.view(2, 4, 4))
    _equal([got], [want])
    assert torch.isfinite(want[:, :9]).all() and torch.isneginf(want[1, 9:]).all()


def test_given_out_is_written_in_place_under_compile():
    torch._dynamo.reset()
    raw = torch.tensor([[0, 63, 64, -1]], dtype=I32)
    table = torch.tensor([[10, 11]], dtype=I32)
    lens = torch.tensor([128], dtype=I32)
    out = torch.full_like(raw, 7)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(raw, table, lens, out):
        return indexcache.translate(raw, table, lens, page_size=64, out=out)

    got = f(raw, table, lens, out)
    assert torch.equal(out, torch.tensor([[640, 703, 704, -1]], dtype=I32))
    assert torch.equal(got, out)


def test_paged_topk_translate_writes_its_logits_and_outputs_in_place_under_compile():
    torch._dynamo.reset()
    args = SPECS["paged_topk_translate"].cases[0].build(torch.Generator().manual_seed(0), "cpu", E4M3)
    want = indexcache.paged_topk_translate(**args)
    want_logits, want_raw = args["logits"].clone(), args["out_raw"].clone()
    args["logits"].fill_(float("nan"))
    args["out_raw"].fill_(-7)
    out = torch.full_like(want, -7)
    got = torch.compile(indexcache.paged_topk_translate, fullgraph=True, backend="aot_eager")(**args, out=out)
    assert torch.equal(got, want) and torch.equal(out, want)
    assert torch.equal(args["logits"], want_logits) and torch.equal(args["out_raw"], want_raw)


def test_the_default_fp8_dtype_compiles_with_fullgraph_and_equals_eager(fresh_dispatch):
    """``fp8_dtype`` left out (None: the device's native fp8 format) in the three ops that take it: resolved while
    Dynamo traces, the first time for this device (nothing kept yet), without a graph break, to e4m3fn on the CPU."""

    def f(keys, cache, slots, table, lens, out_k, out_scale):
        k8, scale = indexcache.quantize_index_k(keys, block=keys.shape[1])
        indexcache.store_index_k(keys, cache, slots)
        gathered = indexcache.gather_index_k(cache, table, lens, dim=keys.shape[1], out_k=out_k, out_scale=out_scale)
        return k8.view(torch.uint8), scale, cache, gathered[0].view(torch.uint8), gathered[1]

    def inputs():
        a = _inputs()
        rows = int(a["lens"][0])
        return (a["keys"], a["cache"], a["slots"], a["table"][:1], a["lens"][:1],
                torch.empty(rows, a["keys"].shape[1], dtype=E4M3), torch.empty(rows))

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*inputs())
    want = f(*inputs())
    _equal(got, want)
    want_k8, _ = indexcache.quantize_index_k(inputs()[0], E4M3, block=inputs()[0].shape[1])
    assert torch.equal(got[0], want_k8.view(torch.uint8))


def test_gather_index_k_writes_its_outputs_in_place_under_compile_and_needs_them():
    torch._dynamo.reset()
    args = SPECS["gather_index_k"].cases[0].build(torch.Generator().manual_seed(0), "cpu")
    want_k, want_scale = indexcache.gather_index_k(**args)
    out_k, out_scale = torch.empty_like(want_k), torch.empty_like(want_scale)
    gather = torch.compile(indexcache.gather_index_k, fullgraph=True, backend="aot_eager")
    got_k, got_scale = gather(**args, out_k=out_k, out_scale=out_scale)
    assert got_k is out_k and got_scale is out_scale
    assert torch.equal(out_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(out_scale.nan_to_num(-1.0), want_scale.nan_to_num(-1.0))
    for name, out in (("out_k", out_k), ("out_scale", out_scale)):  # one is enough: the other takes its rows
        got_k, got_scale = gather(**args, **{name: out.zero_()})
        assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(got_scale.nan_to_num(-1.0), want_scale.nan_to_num(-1.0))
    with pytest.raises(Exception, match="out_k, out_scale: expected one of them or both under torch.compile"):
        gather(**args)


@pytest.mark.parametrize("grouped", [False, True], ids=["one layer", "a group's layers"])
def test_hisparse_swap_in_writes_every_layer_in_place_under_compile(grouped):
    """One layer's tensor or a group's list: the compiled call writes them in place and returns them as given."""
    torch._dynamo.reset()
    case = next(c for c in SPECS["hisparse_swap_in"].cases if "group's four layers" in c.name)
    args = case.build(torch.Generator().manual_seed(0), "cpu")
    if not grouped:
        args.update(host_kv=args["host_kv"][0], device_kv=args["device_kv"][0])
    want = SPECS["hisparse_swap_in"].reference(**args)
    got = torch.compile(indexcache.hisparse_swap_in, fullgraph=True, backend="aot_eager")(**args)
    assert got is args["device_kv"]
    for layer, expected in zip(*((got, want) if grouped else ([got], [want])), strict=True):
        assert torch.equal(layer, expected)


def test_one_layers_swap_in_names_its_kv_alike_under_compile():
    """One layer's tensor goes to the custom op as a list of one: its overlap error (the check op on the real tensors)
    named ``device_kv[0]`` where the eager call names ``device_kv``."""
    torch._dynamo.reset()
    case = next(c for c in SPECS["hisparse_swap_in"].cases if "group's four layers" in c.name)
    args = case.build(torch.Generator().manual_seed(0), "cpu")
    args.update(host_kv=args["device_kv"][0], device_kv=args["device_kv"][0])  # the layer copied onto itself
    with pytest.raises(ValueError, match=r"^device_kv: .*overlaps host_kv") as eager:
        indexcache.hisparse_swap_in(**args)
    with pytest.raises(ValueError) as compiled:
        torch.compile(indexcache.hisparse_swap_in, backend="aot_eager")(**args)
    assert str(compiled.value) == str(eager.value)


def test_errors_are_the_same_under_compile():
    """The spec check runs while Dynamo traces: the same error; with fullgraph, Dynamo reports it as Unsupported
    naming the same message."""
    torch._dynamo.reset()
    raw = torch.zeros(2, 4, dtype=torch.int64)

    def f(r):
        return indexcache.translate(r, r.int(), r[:, 0].int(), 64)

    with pytest.raises(TypeError, match="raw: expected dtype int32, got int64"):
        torch.compile(f, backend="aot_eager")(raw)
    with pytest.raises(Exception, match="raw: expected dtype int32, got int64"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(raw)


@pytest.mark.parametrize("backend", [5, b"torch"], ids=repr)
def test_a_backend_not_a_str_is_named_under_compile(backend):
    """An unknown backend= is an UnknownBackendError in eager mode; under compile a value that is not a str reached
    the custom op's ``str?`` and failed there without naming it (fake tensor call's RuntimeError, Dynamo's internal
    error for bytes). Now it is refused while Dynamo traces: the same error class as eager (the graph breaks), the
    message in Dynamo's report with fullgraph."""
    torch._dynamo.reset()
    scores, lengths = torch.randn(2, 8), torch.tensor([8, 3], dtype=I32)

    def f(s, n):
        return indexcache.topk(s, n, 2, backend=backend)

    with pytest.raises(dispatch.UnknownBackendError, match="^backend: expected one of"):
        f(scores, lengths)
    with pytest.raises(dispatch.UnknownBackendError, match="^backend: expected"):
        torch.compile(f, backend="aot_eager")(scores, lengths)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"backend: expected a backend's name \(a str\) or None, got"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(scores, lengths)


def _overlapping(op: str) -> tuple[dict, str]:
    """Arguments of ``op`` where a written tensor overlaps another argument, and the error that names it."""
    buf = torch.zeros(64, dtype=I32)
    table = torch.tensor([[10, 11]], dtype=I32)
    if op == "translate":  # out over seq_lens
        buf[0] = 128
        return dict(raw=torch.tensor([[0, 63, 64, -1]], dtype=I32), page_table=table, seq_lens=buf[:1],
                    page_size=64, out=buf[:4].view(1, 4)), "out: .*overlaps seq_lens"
    if op == "topk":  # out over lengths
        buf[:2] = 4
        return dict(scores=torch.randn(2, 6), lengths=buf[:2], k=2, out=buf[1:5].view(2, 2)), "out: .*overlaps lengths"
    if op == "topk_translate":  # out_raw over out
        return dict(scores=torch.randn(1, 6), lengths=torch.tensor([6], dtype=I32), k=4, page_table=table,
                    page_size=64, out=buf[:4].view(1, 4), out_raw=buf[2:6].view(1, 4)), "out: .*overlaps out_raw"
    floats = torch.rand(32)  # mqa_logits: out over weights
    return dict(q=torch.randn(2, 2, 16, dtype=torch.bfloat16), k=torch.randn(5, 16, dtype=torch.bfloat16),
                k_scale=torch.ones(5), weights=floats[:4].view(2, 2), ks=torch.zeros(2, dtype=I32),
                ke=torch.tensor([5, 3], dtype=I32), out=floats[2:12].view(2, 5)), "out: .*overlaps weights"


# The ops with an overlap case in _overlapping, and what overlaps what there.
_OVERLAP_CASES = {"translate": "out over seq_lens", "topk": "out over lengths", "topk_translate": "out_raw over out",
                  "mqa_logits": "out over weights"}


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
@pytest.mark.parametrize("op", _OVERLAP_CASES)
def test_overlap_is_checked_under_compile(op, compiler):
    """Fake tensors have no data_ptr(), and under aot_eager functionalization hands the op a copy of what it writes:
    the read-only ``check_<op>`` sees the graph's own tensors when it runs, so compiled calls refuse an overlap as
    eager ones do (aot_eager accepted an ``out`` over ``lengths``)."""
    torch._dynamo.reset()
    args, error = _overlapping(op)
    with pytest.raises(ValueError, match=error):
        getattr(indexcache, op)(**args)  # eager
    f = torch.compile(getattr(indexcache, op), fullgraph=True, backend=compiler)
    with pytest.raises(ValueError, match=error):
        f(**args)


def test_check_ops_are_read_only_and_kept_in_the_graph():
    """Each op that writes in place has a read-only check op, traced before it (not removed as dead code)."""
    assert set(library.CHECKS) == {op for op in SPECS if library.mutated(op)}
    for op, check in library.CHECKS.items():
        assert not check._schema.is_mutable and not check._schema.returns
        assert [a.name for a in check._schema.arguments] == list(library.PARAMS[op])
    torch._dynamo.reset()
    graphs = []

    def keep(gm, inputs):
        graphs.append(gm)
        return gm.forward

    from torch._dynamo.backends.common import aot_autograd

    raw, table, lens = torch.tensor([[0, 63, 64, -1]], dtype=I32), torch.tensor([[10, 11]], dtype=I32), \
        torch.tensor([128], dtype=I32)
    out = torch.empty_like(raw)
    torch.compile(lambda *a: indexcache.translate(*a, 64, out=out), fullgraph=True,
                  backend=aot_autograd(fw_compiler=keep))(raw, table, lens)
    # The op itself is functionalized: it appears as the first argument of an auto_functionalized node.
    calls = [(n.target, *n.args[:1]) for n in graphs[0].graph.nodes if n.op == "call_function"]
    check = next(i for i, call in enumerate(calls) if library.CHECKS["translate"] in call)
    run = next(i for i, call in enumerate(calls) if library.OPS["translate"] in call)
    assert check < run


def test_backend_is_chosen_at_run_time_under_compile(monkeypatch):
    """One compiled graph (fullgraph: no break), the backend picked per call: use_backend() and
    INDEXCACHE_BACKEND in force when it is called are honoured without recompiling."""
    torch._dynamo.reset()
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    raw = torch.tensor([[0, 63, 64, -1]], dtype=I32)
    table = torch.tensor([[10, 11]], dtype=I32)
    lens = torch.tensor([128], dtype=I32)
    want = torch.tensor([[640, 703, 704, -1]], dtype=I32)
    frames = []

    def count(gm, inputs):
        frames.append(gm)
        return gm.forward

    f = torch.compile(lambda raw, table, lens: indexcache.translate(raw, table, lens, 64), fullgraph=True,
                      backend=count)
    with indexcache.use_backend("torch"):
        assert torch.equal(f(raw, table, lens), want)
    # On this CPU machine the cuda backend cannot serve: an explicit choice of it must raise, from the same graph.
    if "cuda" not in dispatch.available_backends():
        with indexcache.use_backend("cuda"), pytest.raises(BackendNotSupportedError, match="use_backend"):
            f(raw, table, lens)
        monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
        with pytest.raises(BackendNotSupportedError, match=dispatch.ENV_VAR):
            f(raw, table, lens)
        monkeypatch.setenv(dispatch.ENV_VAR, "torch")
        assert torch.equal(f(raw, table, lens), want)
    assert len(frames) == 1


def test_eager_calls_do_not_go_through_torch_ops(monkeypatch):
    """The eager fast path: outside compile, the wrapper calls dispatch directly."""
    def boom(*args, **kwargs):
        raise AssertionError("went through torch.ops")

    monkeypatch.setitem(library.OPS, "translate", boom)
    raw = torch.tensor([[0, 63, 64, -1]], dtype=I32)
    got = indexcache.translate(raw, torch.tensor([[10, 11]], dtype=I32), torch.tensor([128], dtype=I32), 64)
    assert torch.equal(got, torch.tensor([[640, 703, 704, -1]], dtype=I32))


@pytest.mark.skipif(os.environ.get("INDEXCACHE_SKIP_INDUCTOR") == "1", reason="INDEXCACHE_SKIP_INDUCTOR=1")
def test_inductor_compiles_mxfp4_keys_and_queries():
    """MXFP4's e8m0 scales cross the custom ops as uint8 views: Inductor lowers quantize_index_k to MXFP4 (the scales
    it allocates) and the prefill logits over MXFP4 keys and queries, equal to eager (before, it failed with
    "auto_functionalized_v2 was not removed" on any op that writes in place with an e8m0 argument)."""
    torch._dynamo.reset()
    fp4 = torch.float4_e2m1fn_x2
    g = torch.Generator().manual_seed(0)
    raw_q, raw_k = torch.randn(8, 128, generator=g), torch.randn(30, 128, generator=g)
    weights, ks, ke = torch.randn(2, 4, generator=g), torch.zeros(2, dtype=I32), torch.tensor([30, 9], dtype=I32)

    def f(raw_q, raw_k, weights, ks, ke):
        q, q_scale = indexcache.quantize_index_k(raw_q, fp4)
        k, k_scale = indexcache.quantize_index_k(raw_k, fp4)
        logits = indexcache.mqa_logits(q.view(2, 4, 64), k, k_scale, weights, ks, ke, q_scale=q_scale.view(2, 4, 4))
        return q.view(torch.uint8), q_scale.view(torch.uint8), k_scale.view(torch.uint8), logits

    args = (raw_q, raw_k, weights, ks, ke)
    want = f(*args)
    _equal(torch.compile(f, fullgraph=True, backend="inductor")(*args), want)
    assert torch.isfinite(want[3][:, :9]).all() and torch.isneginf(want[3][1, 9:]).all()


def test_a_custom_op_views_the_e8m0_positions_back_and_refuses_a_tensor_not_uint8_there():
    """``e8m0`` names the positions of scales passed as uint8 views; the op views them back (equal to the public op),
    and a position whose tensor is not uint8 is a TypeError naming the argument."""
    g = torch.Generator().manual_seed(0)
    k, k_scale = indexcache.quantize_index_k(torch.randn(30, 128, generator=g), torch.float4_e2m1fn_x2)
    q = torch.randn(2, 4, 128, generator=g).to(torch.float8_e4m3fn)
    args = dict(q=q, k=k, k_scale=k_scale, weights=torch.randn(2, 4, generator=g), ks=torch.zeros(2, dtype=I32),
                ke=torch.tensor([30, 9], dtype=I32))
    want = indexcache.mqa_logits(**args, backend="torch")
    checked = SPECS["mqa_logits"].check(**args)
    arguments = library.op_arguments("mqa_logits", checked, "torch")
    position = library.PARAMS["mqa_logits"].index("k_scale")
    assert arguments[-1] == [position] and arguments[position].dtype == torch.uint8
    library.OPS["mqa_logits"](*arguments)
    _equal([checked["out"]], [want])
    arguments[position] = k_scale.float()
    with pytest.raises(TypeError, match="'k_scale'.*uint8 view of a float8_e8m0fnu tensor, got torch.float32"):
        library.OPS["mqa_logits"](*arguments)


@pytest.mark.skipif(os.environ.get("INDEXCACHE_SKIP_INDUCTOR") == "1", reason="INDEXCACHE_SKIP_INDUCTOR=1")
def test_inductor_compiles_translate_and_topk():
    torch._dynamo.reset()
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.7], [0.3, 0.2, 0.0, 0.0]])
    lens = torch.tensor([4, 2], dtype=I32)
    table = torch.tensor([[5, 6], [7, 8]], dtype=I32)

    def f(scores, lens, table):
        raw = indexcache.topk(scores * 2, lens, 2, sorted=True)
        return indexcache.translate(raw, table, lens, 2) + 1

    assert torch.equal(torch.compile(f, fullgraph=True)(scores, lens, table), f(scores, lens, table))


@pytest.mark.parametrize("dynamic", [False, True], ids=["dynamic=False", "dynamic=True"])
def test_small_model_runs_compiled_and_equals_eager(dynamic):
    """The small DSA model's forward under torch.compile (graph breaks allowed: the runner's plan lookups; the
    stream scheduler ``overlap`` runs its two functions in order inside the graph). With ``dynamic=True`` the
    runner's range of layers is symbolic, which ``runner.layer`` could not trace (InternalTorchDynamoError)."""
    from indexcache.runtime.runner import IndexerRunner
    from indexcache.tools.model import DSAModel, preset

    torch._dynamo.reset()
    cfg = preset("v32-like", num_layers=4, hidden=64, heads=2, head_dim=32, index_heads=2, topk=16, page_size=8,
                 vocab=64, window=16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in (48, 30)]
    model = DSAModel(cfg)
    want = model.generate(prompts, 2, IndexerRunner(model.plan(2)))
    compiled = DSAModel(cfg)
    with torch._dynamo.config.patch(recompile_limit=64):
        compiled.forward = torch.compile(compiled.forward, backend="aot_eager", dynamic=dynamic)
        got = compiled.generate(prompts, 2, IndexerRunner(compiled.plan(2)))
    assert torch.equal(got.prefill_logits, want.prefill_logits)
    assert torch.equal(got.decode_logits, want.decode_logits)
    assert torch.equal(got.tokens, want.tokens)


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic dynamic", "dynamic=True"])
def test_a_layer_index_passed_to_a_compiled_step_is_specialized_per_layer(dynamic):
    """A compiled step taking the layer index as an argument: Dynamo makes that int symbolic (with ``dynamic=True``,
    or automatic dynamic shapes at the second layer), and with ``dynamic=True`` the ends of the range of a runner the
    step closes over too; ``runner.layer`` tested the index with ``in range(...)``, which Dynamo cannot trace on
    symbolic ints (InternalTorchDynamoError, no fallback to eager). The runner specializes the index: one graph a
    layer, each equal to eager."""
    from indexcache.plan import LayerPlan
    from indexcache.runtime.runner import IndexerRunner
    from indexcache.runtime.state import TopkState

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    runner = IndexerRunner(LayerPlan(4, index_topk_freq=2, index_topk=4, page_size=8))  # roles F F S F
    g = torch.Generator().manual_seed(0)
    scores, lengths = torch.randn(5, 30, generator=g), torch.randint(0, 31, (5,), generator=g, dtype=I32)
    tables = torch.randint(0, 50, (4, 5, 4), generator=g, dtype=I32)

    def step(layer, state, table):
        return runner.layer(layer, state, scores=lambda: scores * (layer + 1), lengths=lengths, page_table=table)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    eager_state, compiled_state = TopkState(8, 4), TopkState(8, 4)
    runner.begin(eager_state, 5)
    runner.begin(compiled_state, 5)
    for layer in runner.layers:
        want = step(layer, eager_state, tables[layer]).clone()
        assert torch.equal(compiled(layer, compiled_state, tables[layer]), want)
        assert compiled_state.producer == eager_state.producer == runner.source_of(layer)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 4


def test_overlap_traces_without_a_graph_break():
    """Under torch.compile ``overlap`` runs side then main in the graph (no stream is traced): fullgraph works."""
    from indexcache.runtime.streams import overlap

    torch._dynamo.reset()

    def f(x):
        side, main = overlap(lambda: x * 2, lambda: x + 1, device=x.device)
        return side - main

    x = torch.arange(6.0)
    assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(x), f(x))


def test_a_budget_given_as_an_argument_compiles_once_with_dynamic_shapes_and_runs_under_each_value(monkeypatch):
    """The custom op's ``sm_budget`` was an ``int?``: with dynamic=True, Dynamo specialized a budget given as an
    argument of the compiled function, one recompile per value (past the recompile limit, eager). As ``SymInt?`` it is
    one graph, and each call runs under its own budget."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    seen = []
    call = dispatch.call

    def spy(op, args, backend=None):
        seen.append(budget.current())
        return call(op, args, backend)

    monkeypatch.setattr(dispatch, "call", spy)
    scores, lengths = torch.randn(3, 30), torch.tensor([30, 4, 12], dtype=I32)
    f = torch.compile(lambda s, n, b: indexcache.topk(s, n, 4, sm_budget=b, sorted=True), fullgraph=True,
                      backend="aot_eager", dynamic=True)
    want = indexcache.topk(scores, lengths, 4, sorted=True)
    seen.clear()
    for b in (4, 5, 6, 7):
        assert torch.equal(f(scores, lengths, b), want)
    assert seen == [4, 5, 6, 7]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_dynamic_shapes_and_ints():
    """With dynamic=True the sizes and the int arguments (page_size, k) are symbolic while Dynamo traces."""
    torch._dynamo.reset()
    translate = torch.compile(lambda raw, table, lens, p: indexcache.translate(raw, table, lens, p), fullgraph=True,
                              backend="aot_eager", dynamic=True)
    topk = torch.compile(lambda s, lens, k: indexcache.topk(s, lens, k, sorted=True), fullgraph=True,
                         backend="aot_eager", dynamic=True)
    g = torch.Generator().manual_seed(0)
    table, lens = torch.tensor([[10, 11, 12]], dtype=I32), torch.tensor([100], dtype=I32)
    for p, n, k in ((64, 4, 2), (32, 6, 3), (16, 9, 5)):
        raw = torch.arange(n, dtype=I32)[None]
        assert torch.equal(translate(raw, table, lens, p), indexcache.translate(raw, table, lens, p))
        scores, lengths = torch.randn(3, 20, generator=g), torch.tensor([20, 4, 10], dtype=I32)
        assert torch.equal(topk(scores, lengths, k), indexcache.topk(scores, lengths, k, sorted=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the cuda backend compiled needs a GPU")
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_every_op_compiles_on_the_gpu_and_equals_eager(compiler):
    """On a GPU (cuda backend): every op but gather_index_k and the HiSparse two in one fullgraph compile equal to
    eager, then the compiled function captured in a CUDA graph and replayed equal to eager too (ci/gpu.sh runs this; a
    skip there fails the step)."""
    if dispatch.get_backend() != "cuda":
        pytest.skip(f"the cuda backend is not the one in force here ({dispatch.get_backend()})")
    torch._dynamo.reset()
    inputs = {name: v.cuda() if isinstance(v, torch.Tensor) else v for name, v in _inputs().items()}
    fresh = {name: v.clone() if isinstance(v, torch.Tensor) else v for name, v in inputs.items()}
    want = every_op(**fresh)
    compiled = torch.compile(every_op, fullgraph=True, backend=compiler)
    _equal(compiled(**{name: v.clone() if isinstance(v, torch.Tensor) else v for name, v in inputs.items()}), want)

    static = {name: v.clone() if isinstance(v, torch.Tensor) else v for name, v in inputs.items()}
    compiled(**static)  # warm-up outside the capture (compiles; the top-k workspace is taken here)
    torch.cuda.synchronize()
    static["cache"].copy_(inputs["cache"])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = compiled(**static)
    static["cache"].copy_(inputs["cache"])
    graph.replay()
    torch.cuda.synchronize()
    _equal(captured, want)


def test_a_strided_out_compiles_in_full_once_shapes_are_symbolic_and_an_overlapping_one_is_still_refused():
    """The check that an out's elements do not overlap ordered its strides: symbolic after the first recompile, which
    fullgraph refused (sort with non-constant keys). Traced, only the stride-0 test runs; the custom op's real
    implementation refuses an overlapping view as eagerly."""
    g = torch.compile(lambda r, t, n, o: indexcache.translate(r, t, n, 64, out=o), fullgraph=True, backend="eager")
    for rows in (2, 3, 4):
        raw, table = torch.randint(-1, 200, (rows, 4), dtype=torch.int32), torch.randint(0, 9, (rows, 3),
                                                                                          dtype=torch.int32)
        lens = torch.full((rows,), 150, dtype=torch.int32)
        out = torch.zeros(rows, 8, dtype=torch.int32)[:, :4]
        assert torch.equal(g(raw, table, lens, out), indexcache.translate(raw, table, lens, 64, backend="torch"))
    overlapping = torch.zeros(4, dtype=torch.int32).as_strided((2, 3), (1, 1))
    with pytest.raises(ValueError, match="^out: expected a tensor whose elements have memory of their own, got a view"):
        g(raw[:2, :3], table[:2], lens[:2], overlapping)


def _quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return indexcache.quantize_index_k(x, E4M3, block=x.shape[-1], backend="torch")


def _filled_cache(gen, pages: int, page: int, dim: int) -> torch.Tensor:
    cache = new_packed_cache(num_pages=pages, page_size=page, dim=dim)
    indexcache.store_index_k(torch.randn(pages * page, dim, generator=gen), cache,
                             torch.arange(pages * page, dtype=I32), E4M3, backend="torch")
    return cache


def _paged_inputs(gen, n: int, ints: bool) -> tuple:
    """Decode inputs of ``n`` requests (one token each) over a 16-page cache of 8-token pages, D 32; ``ints``: a
    ``max_context_len`` that changes with ``n`` (an int argument, symbolic only with ``dynamic=True``)."""
    heads, dim, page, pages = 2, 32, 8, 16
    q, _ = _quantized(torch.randn(n * heads, dim, generator=gen))
    table = torch.stack([torch.randperm(pages, generator=gen) for _ in range(n)]).to(I32)
    return (q.view(n, 1, heads, dim), _filled_cache(gen, pages, page, dim), torch.rand(n, heads, generator=gen),
            torch.randint(1, pages * page, (n,), generator=gen, dtype=I32), table, pages * page - 8 * n * ints)


def _prefill_inputs(gen, n: int) -> tuple:
    """Prefill inputs of ``n`` query tokens over ``10 + 4 n`` keys, D 32."""
    heads, dim, keys = 2, 32, 10 + 4 * n
    q, _ = _quantized(torch.randn(n * heads, dim, generator=gen))
    k, k_scale = _quantized(torch.randn(keys, dim, generator=gen))
    return (q.view(n, heads, dim), k, k_scale[:, 0].contiguous(), torch.rand(n, heads, generator=gen),
            torch.randint(0, 4, (n,), generator=gen, dtype=I32), torch.randint(4, keys + 1, (n,), generator=gen,
                                                                               dtype=I32))


def _gather(cache, table, lens, out_k, out_scale, dim):
    k, k_scale = indexcache.gather_index_k(cache, table, lens, dim=dim, out_k=out_k, out_scale=out_scale)
    return k.view(torch.uint8), k_scale


def _store(k, cache, slots):
    indexcache.store_index_k(k, cache, slots, E4M3)
    return cache


def _plan(raw, seq_lens, host_loc, slot_token, slot_age):
    return tuple(indexcache.hisparse_plan(raw, seq_lens, host_loc, slot_token, slot_age))


def _dynamic_case(op: str, n: int, gen, ints: bool) -> tuple:
    """``(function, arguments, the (argument, dim) pairs that grow with n)`` of ``op`` at batch size / token count
    ``n``: the token or batch dimension, and where the op has one the key count or context length too (``ints``: the
    paged ops' ``max_context_len`` as well). No two sizes of one call are equal (duck sizing would tie them)."""
    rand = torch.randint
    if op == "translate":
        return (lambda raw, table, lens: indexcache.translate(raw, table, lens, 32),
                (rand(-1, 100, (n, 7), generator=gen, dtype=I32), rand(0, 20, (n, 4), generator=gen, dtype=I32),
                 rand(0, 130, (n,), generator=gen, dtype=I32)), [(0, 0), (1, 0), (2, 0)])
    if op in ("topk", "topk_translate"):
        cols = 20 + 3 * n
        args = (torch.randn(n, cols, generator=gen), rand(0, cols + 1, (n,), generator=gen, dtype=I32))
        if op == "topk":
            return lambda s, lens: indexcache.topk(s, lens, 4, sorted=True), args, [(0, 0), (0, 1), (1, 0)]
        return (lambda s, lens, table: indexcache.topk_translate(s, lens, 4, table, 8, sorted=True),
                (*args, rand(0, 20, (n, 9), generator=gen, dtype=I32)), [(0, 0), (0, 1), (1, 0), (2, 0)])
    if op == "mqa_logits":
        return indexcache.mqa_logits, _prefill_inputs(gen, n), [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (5, 0)]
    if op == "mqa_topk_translate":
        args = _prefill_inputs(gen, n)
        table = rand(0, 50, (n, 3 * n + 1), generator=gen, dtype=I32)
        return (lambda *a: indexcache.mqa_topk_translate(*a[:6], 4, a[6], 8, workspace_bytes=1 << 16).sort(1).values,
                (*args, table), [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0), (6, 1)])
    if op == "paged_mqa_logits":
        return indexcache.paged_mqa_logits, _paged_inputs(gen, n, ints), [(0, 0), (2, 0), (3, 0), (4, 0)]
    if op == "paged_topk_translate":
        args = _paged_inputs(gen, n, ints)
        return (lambda *a: indexcache.paged_topk_translate(*a[:6], 4, a[6], 8).sort(1).values,
                (*args, args[4].clone()), [(0, 0), (2, 0), (3, 0), (4, 0), (6, 0)])
    if op == "quantize_index_k":
        return (lambda x: tuple(t.view(torch.uint8) if t.dtype == E4M3 else t
                                for t in indexcache.quantize_index_k(x, E4M3, block=32)),
                (torch.randn(n, 64, generator=gen),), [(0, 0)])
    if op == "store_index_k":
        return (_store, (torch.randn(n, 32, generator=gen), new_packed_cache(num_pages=8, page_size=8, dim=32),
                         torch.randperm(64, generator=gen)[:n].to(I32)), [(0, 0), (2, 0)])
    if op == "gather_index_k":
        lens = rand(0, 33, (n,), generator=gen, dtype=I32)
        rows = int(lens.sum()) + 2
        return (_gather, (_filled_cache(gen, 16, 8, 32), rand(0, 16, (n, 5), generator=gen, dtype=I32), lens,
                          torch.zeros(rows, 32, dtype=E4M3), torch.zeros(rows), 32), [(1, 0), (2, 0), (3, 0), (4, 0)])
    hot, tokens = 4, 40
    slot_token, slot_age = indexcache.hal.hisparse.empty_state(n, hot)
    plan = (rand(-1, 30, (n, 5), generator=gen, dtype=I32), rand(1, 30, (n,), generator=gen, dtype=I32),
            torch.arange(n * tokens, dtype=I32).view(n, tokens), slot_token, slot_age)
    if op == "hisparse_plan":
        return _plan, plan, [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0)]
    copies = indexcache.hisparse_plan(*plan, backend="torch").copies
    return (indexcache.hisparse_swap_in, (*copies, torch.randn(n * tokens, 6, generator=gen),
                                          torch.zeros(n * (hot + 1), 6),
                                          torch.arange(n * (hot + 1), dtype=I32).view(n, hot + 1)),
            [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (5, 0)])


def _same(got, want) -> None:
    """Equal outputs, bit for bit (NaN included), of equal shapes, strides and dtypes."""
    if isinstance(want, (tuple, list)):
        for g, w in zip(got, want, strict=True):
            _same(g, w)
        return
    assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


_INDUCTOR = pytest.param("inductor", marks=pytest.mark.skipif(os.environ.get("INDEXCACHE_SKIP_INDUCTOR") == "1",
                                                                reason="INDEXCACHE_SKIP_INDUCTOR=1"))


@pytest.mark.parametrize("compiler", ["aot_eager", _INDUCTOR])
@pytest.mark.parametrize("dynamic", ["mark_dynamic", "dynamic=True"])
@pytest.mark.parametrize("op", SPECS)
def test_every_op_compiles_once_for_every_batch_size(op, dynamic, compiler):
    """As vLLM compiles a model (``mark_dynamic`` on the token / batch dimension, fullgraph, Inductor) or with
    ``dynamic=True`` (the int arguments symbolic too): one graph, then batch sizes, token counts, key counts and context
    lengths it has not seen run without recompiling, equal to eager (the arguments an op writes too)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ints = dynamic == "dynamic=True"
    fn = _dynamic_case(op, 3, torch.Generator().manual_seed(0), ints)[0]
    compiled = torch.compile(fn, fullgraph=True, backend=compiler, dynamic=True if ints else None)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n in (3, 5, 8):
            fn, args, grows = _dynamic_case(op, n, torch.Generator().manual_seed(n), ints)
            eager = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            traced = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            if not ints:
                for i, d in grows:
                    torch._dynamo.mark_dynamic(traced[i], d)
            want = fn(*eager)
            _same(compiled(*traced), want)
            _same([a for a in traced if isinstance(a, torch.Tensor)], [a for a in eager if isinstance(a, torch.Tensor)])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("view", ["flat", "4-D"])
def test_the_cache_shape_is_not_specialized_with_dynamic_shapes(view):
    """The cache's shape check formatted its error text on every call and read the page size with ``int()``: traced
    with ``dynamic=True`` that specialized the key dim and the page's bytes (a recompile for another page size), and an
    int argument for ``dim`` (``gather_index_k``) failed to trace at all ("BUILD_STRING type error")."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    def store_then_gather(k, slots, cache, table, lens, out_k, out_scale, dim):
        return _store(k, cache, slots), *_gather(cache, table, lens, out_k, out_scale, dim)

    compiled = torch.compile(store_then_gather, fullgraph=True, backend="aot_eager", dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for page, dim in ((8, 32), (16, 64), (4, 96)):
            gen = torch.Generator().manual_seed(page)
            cache = new_packed_cache(num_pages=6, page_size=page, dim=dim)
            if view == "4-D":
                cache = cache.view(6, page, 1, -1)
            args = (torch.randn(5, dim, generator=gen), torch.randperm(6 * page, generator=gen)[:5].to(I32), cache,
                    torch.randint(0, 6, (3, 5), generator=gen, dtype=I32), torch.tensor([7, 0, 13], dtype=I32),
                    torch.zeros(21, dim, dtype=E4M3), torch.zeros(21), dim)
            want = store_then_gather(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
            _same(compiled(*args), want)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_overlap_and_a_schedule_given_symbolic_sizes_compile_once():
    """``overlap`` and ``overlap_schedule`` given the side work's rows and keys from the (dynamic) shapes, and a
    schedule made eagerly, run in one graph for every batch size, equal to eager."""
    from indexcache.runtime.streams import overlap, overlap_schedule

    made = overlap_schedule(device="cpu", tokens=4, context=100)

    def f(scores, lengths, x):
        rows, cols = scores.shape
        side, main = overlap(lambda: indexcache.topk(scores, lengths, 4, sorted=True), lambda: x * 2,
                             device=x.device, tokens=rows, context=cols)
        schedule = overlap_schedule(device=x.device, tokens=rows, context=cols)
        again = schedule(lambda: indexcache.topk(scores * 2, lengths, 3, sorted=True), lambda: x + 1)
        return side, main, *again, made(lambda: indexcache.topk(scores, lengths, 2, sorted=True), lambda: x)[0]

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n in (3, 5, 8):
            g = torch.Generator().manual_seed(n)
            args = (torch.randn(n, 20 + n, generator=g), torch.randint(0, 21 + n, (n,), generator=g, dtype=I32),
                    torch.randn(n, 7, generator=g))
            for t in args:
                torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(args[0], 1)
            _same(compiled(*args), f(*args))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
