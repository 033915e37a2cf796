"""``indexcache conformance`` on an interpreted Triton backend prints no warning of Triton's interpreter: the cases
that feed NaN and inf on purpose made its numpy casts warn, with an absolute path, on every run (issue 35 item 7)."""

import json
import warnings

import pytest
import torch

from indexcache.conformance import worker

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted checks"),
              pytest.mark.usefixtures("interpreted")]


def test_the_worker_prints_no_interpreter_cast_warning(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert worker.main(["--backend", "cuda", "--op", "quantize_index_k", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "conformance-cuda.json").read_text())
    assert report["mode"] == "interpreted"
    assert any("NaN" in r["case"] and r["status"] == "passed" for r in report["results"])
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []
