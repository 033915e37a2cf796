"""Dispatch rules: automatic choice, explicit choices, fallback with logged reasons, plugins."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import indexcache
from indexcache.hal import dispatch
from indexcache.hal.contract import Availability, Backend, Capabilities, OpImpl

I32 = torch.int32


def _translate_args():
    return (torch.tensor([[0, 5, -1]], dtype=I32), torch.tensor([[3]], dtype=I32), torch.tensor([8], dtype=I32), 16)


PLUGIN = textwrap.dedent('''
    import torch
    from indexcache.hal.contract import Availability, Backend, OpImpl

    CALLS = []

    def _translate(raw, page_table, seq_lens, page_size, row_to_batch, out):
        CALLS.append(page_size)
        return out.fill_(7)

    def _supports(page_size, row_to_batch, **_):
        reasons = [] if page_size == 16 else [f"fake serves page_size 16 only, got {page_size}"]
        if row_to_batch is not None:
            reasons.append("fake takes no row_to_batch")
        return reasons

    BACKEND = Backend(name="fake", priority=100,
                      probe=lambda: Availability(True, "always here", auto=True, mode="CPU", device="cpu"),
                      ops={"translate": OpImpl(_translate, _supports)})
''')


@pytest.fixture
def plugin(tmp_path, monkeypatch, fresh_dispatch):
    """A third-party backend registered through the ``indexcache.backends`` entry-point group."""
    (tmp_path / "fake_backend.py").write_text(PLUGIN)
    dist = tmp_path / "fake_backend-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-backend\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[indexcache.backends]\nfake = fake_backend:BACKEND\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    dispatch.reset()
    import fake_backend

    fake_backend.CALLS.clear()
    yield fake_backend
    sys.modules.pop("fake_backend", None)


def test_cpu_machine_selects_torch(fresh_dispatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible; the automatic choice is a GPU backend")
    name, why = dispatch.default_backend()
    assert name == "torch" and why
    assert indexcache.get_backend() == "torch"


def test_prepare_does_what_a_first_call_sets_up_so_that_the_call_does_none_of_it(fresh_dispatch):
    assert fresh_dispatch.ops_of.cache_info().currsize == 0
    assert fresh_dispatch.prepare() == indexcache.get_backend()
    built = fresh_dispatch.ops_of.cache_info()
    assert built.currsize == 1 and fresh_dispatch.default_backend.cache_info().currsize == 1
    # on the chosen backend's device: a GPU backend declines CPU tensors, and the torch backend serving them is built
    dev = "cuda" if indexcache.get_backend() in ("cuda", "rocm") else "cpu"
    raw = torch.tensor([[0, 5, -1]], dtype=torch.int32, device=dev)
    out = indexcache.translate(raw, torch.tensor([[3]], dtype=torch.int32, device=dev),
                               torch.tensor([8], dtype=torch.int32, device=dev), 16)
    assert out.tolist() == [[48, 53, -1]]
    assert fresh_dispatch.ops_of.cache_info().misses == built.misses  # nothing built at the call


def test_prepare_builds_the_explicitly_chosen_backend_and_names_a_wrong_choice(fresh_dispatch, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert fresh_dispatch.prepare() == "torch"
    monkeypatch.setenv(dispatch.ENV_VAR, "nope")
    with pytest.raises(dispatch.UnknownBackendError, match="INDEXCACHE_BACKEND: expected one of"):
        fresh_dispatch.prepare()


def test_env_var_is_an_explicit_choice(fresh_dispatch, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert dispatch.explicit_choice() == ("torch", f"{dispatch.ENV_VAR}=torch")
    assert indexcache.get_backend() == "torch"


def test_unknown_backend_names_the_known_ones(fresh_dispatch):
    with pytest.raises(dispatch.UnknownBackendError, match=r"backend: expected one of .*'torch'.*got 'nope'"):
        indexcache.translate(*_translate_args(), backend="nope")
    with pytest.raises(ValueError, match="nope"), indexcache.use_backend("nope"):
        pass


def test_explicit_unavailable_backend_raises_with_reason(fresh_dispatch, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("cuda is available here")
    dispatch.reset()
    expected = r"'cuda' \(chosen by backend= argument\).*not available"
    with pytest.raises(dispatch.BackendNotSupportedError, match=expected):
        indexcache.translate(*_translate_args(), backend="cuda")


def test_use_backend_context(fresh_dispatch):
    with indexcache.use_backend("torch"):
        assert indexcache.get_backend() == "torch"
        assert dispatch.explicit_choice() == ("torch", "use_backend()")
    assert dispatch.explicit_choice() is None


def test_plugin_is_auto_selected_and_serves(plugin):
    assert "fake" in dispatch.registry()
    assert indexcache.get_backend() == "fake"
    out = indexcache.translate(*_translate_args())
    assert out.tolist() == [[7, 7, 7]] and plugin.CALLS == [16]


def test_automatic_fallback_logs_reason_once(plugin, caplog):
    raw, table, seq, _ = _translate_args()
    with caplog.at_level(logging.INFO, logger="indexcache"):
        out = indexcache.translate(raw, table, seq, 4)
        indexcache.translate(raw, table, seq, 4)
    assert out.tolist() == [[12, -1, -1]]  # served by torch: position 5 lies on page 1, beyond the table
    assert plugin.CALLS == []
    messages = [r.getMessage() for r in caplog.records if "falls back from fake" in r.getMessage()]
    assert messages == ["indexcache: translate falls back from fake to torch: fake serves page_size 16 only, got 4"]


def test_explicit_choice_that_declines_raises_every_reason(plugin):
    raw, table, seq, _ = _translate_args()
    with pytest.raises(dispatch.BackendNotSupportedError, match="fake serves page_size 16 only, got 4$"):
        indexcache.translate(raw, table, seq, 4, backend="fake")
    every = "cannot run translate: fake serves page_size 16 only, got 4; fake takes no row_to_batch$"
    with pytest.raises(dispatch.BackendNotSupportedError, match=every):
        indexcache.translate(raw, table, seq, 4, row_to_batch=torch.zeros(1, dtype=I32), backend="fake")
    declined = pytest.raises(dispatch.BackendNotSupportedError, match="does not implement topk")
    with declined, indexcache.use_backend("fake"):
        indexcache.topk(torch.zeros(1, 4), torch.tensor([4], dtype=I32), 2)


def test_an_explicit_choice_declining_without_a_reason_says_so(fresh_dispatch):
    """A backend whose supports() declines with blank reasons only: the error says it gave none (not an empty tail),
    and keeps the reasons as given (the conformance suite fails such a decline)."""
    blank = Backend(name="blank", priority=-1, probe=lambda: Availability(True, "test"),
                    ops={"translate": OpImpl(lambda **_: None, lambda **_: ["", "  "])})
    fresh_dispatch.registry()["blank"] = blank
    with pytest.raises(dispatch.BackendNotSupportedError,
                       match=r"cannot run translate: it gave no reason \(its supports\(\) must say why\)$") as err:
        indexcache.translate(*_translate_args(), backend="blank")
    assert err.value.reasons == ["", "  "]


def test_fallback_logs_every_reason(plugin, caplog):
    raw, table, seq, _ = _translate_args()
    with caplog.at_level(logging.INFO, logger="indexcache"):
        indexcache.translate(raw, table, seq, 4, row_to_batch=torch.zeros(1, dtype=I32))
    messages = [r.getMessage() for r in caplog.records if "falls back from fake" in r.getMessage()]
    assert messages == ["indexcache: translate falls back from fake to torch: fake serves page_size 16 only, got 4; "
                        "fake takes no row_to_batch"]


def test_supports_must_return_a_list(fresh_dispatch):
    legacy = Backend(name="legacy", priority=-1, probe=lambda: Availability(True, "test"),
                     ops={"translate": OpImpl(lambda **_: None, lambda **_: (True, ""))})
    fresh_dispatch.registry()["legacy"] = legacy
    with pytest.raises(TypeError, match=r"backend 'legacy': supports\(\) of translate must return a list .*got tuple"):
        indexcache.translate(*_translate_args(), backend="legacy")


def test_backend_names_stay_importable_from_dispatch():
    assert (dispatch.Backend, dispatch.OpImpl, dispatch.Availability) == (Backend, OpImpl, Availability)


def test_capabilities_are_typed_and_info_shows_them(fresh_dispatch, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("INDEXCACHE_ROCM_ARCH", raising=False)
    fresh_dispatch.reset()
    if not (avail := fresh_dispatch.availability("rocm")).available:
        pytest.skip(avail.reason)
    caps = fresh_dispatch.get("rocm").capabilities()
    assert (caps.fp8_dtype, caps.arch, caps.side_streams) == (torch.float8_e4m3fnuz, "gfx942", 2)
    info = fresh_dispatch.get("rocm").info()
    assert list(info) == ["arch", "fp8_dtype", "side_streams", "tuning"]
    assert info["fp8_dtype"] == "torch.float8_e4m3fnuz"
    assert fresh_dispatch.get("torch").capabilities() == Capabilities()
    assert list(fresh_dispatch.get("torch").info()) == ["memory_budget_bytes"]


def test_import_touches_no_device():
    code = (
        "import indexcache, torch\n"
        "from indexcache.hal import dispatch\n"
        "assert dispatch.availability.cache_info().currsize == 0\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.parametrize("value", [None, "", "torch", "cuda", "naïve ümlaut"])
def test_the_environment_reader_reads_what_os_environ_get_reads(monkeypatch, value):
    name = "INDEXCACHE_TEST_READER"
    read = dispatch._environ_reader(name)
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    assert read() == os.environ.get(name)
    monkeypatch.setenv(name, "later")  # read at each call, not once
    assert read() == "later"
    monkeypatch.delenv(name)
    assert read() is None


def test_the_environment_reader_falls_back_to_get_without_cpythons_mapping(monkeypatch):
    monkeypatch.setattr(dispatch.os, "environ", {"INDEXCACHE_TEST_READER": "rocm"})
    read = dispatch._environ_reader("INDEXCACHE_TEST_READER")
    assert read() == "rocm"
    dispatch.os.environ["INDEXCACHE_TEST_READER"] = "torch"
    assert read() == "torch"
