"""The GPU backends' producer step of decode (``backends/triton/producer.py``), interpreted on the CPU: each draft
row's length and request as the top-k takes them, and the step with three draft tokens (the conformance cases take
one and two) equal to the torch backend's."""

from __future__ import annotations

import pytest
import torch

import indexcache
from indexcache.hal.layout import new_packed_cache

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted checks"),
              pytest.mark.usefixtures("interpreted")]


def test_each_draft_row_gets_its_length_and_request():
    from indexcache.backends.triton import producer
    from indexcache.backends.triton.launcher import Launch

    context_lens = torch.tensor([0, 1, 2, 700, -5], dtype=torch.int32)
    lengths, requests = (torch.full((15,), 99, dtype=torch.int32) for _ in range(2))
    Launch(producer.DRAFT_ROWS, (1,), (("num_warps", 4),), (context_lens, lengths, requests, 15, 1),
           dict(NEXT_N=3, BLOCK=producer.DRAFT_BLOCK))()
    assert lengths.tolist() == [-2, -1, 0, -1, 0, 1, 0, 1, 2, 698, 699, 700, -2, -1, 0]
    assert requests.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]


def test_three_draft_tokens_select_from_their_logits():
    g = torch.Generator().manual_seed(3)
    cache = new_packed_cache(6, 64, 128)
    indexcache.store_index_k(torch.randn(6 * 64, 128, generator=g), cache, torch.arange(6 * 64, dtype=torch.int32),
                             backend="torch")
    q = torch.randn(2, 3, 16, 128, generator=g).to(torch.float8_e4m3fn)
    args = (q, cache, torch.randn(6, 16, generator=g), torch.tensor([150, 3], dtype=torch.int32),
            torch.tensor([[2, 0, 5], [1, 3, 4]], dtype=torch.int32), 192, 20,
            torch.tensor([[7, 1, -1, 9], [4, 4, 2, 0]], dtype=torch.int32), 64)
    got_raw, want_raw = (torch.empty(6, 20, dtype=torch.int32) for _ in range(2))
    got_logits = torch.empty(6, 192)
    got = indexcache.paged_topk_translate(*args, logits=got_logits, out_raw=got_raw, backend="cuda")
    want_logits = indexcache.paged_mqa_logits(*args[:6], backend="torch")
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-4)
    lengths = torch.tensor([148, 149, 150, 1, 2, 3], dtype=torch.int32)  # context - next_n + 1 + j
    want = indexcache.topk_translate(got_logits, lengths, 20, args[7], 64, out_raw=want_raw,
                                     row_to_batch=torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.int32), backend="torch")
    assert [sorted(r) for r in got_raw.tolist()] == [sorted(r) for r in want_raw.tolist()]
    assert [sorted(r) for r in got.tolist()] == [sorted(r) for r in want.tolist()]
