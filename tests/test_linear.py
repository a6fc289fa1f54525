"""The serving linear layers: the same float32 product as F.linear at every row count, and a bounded
set of row buckets (oneDNN caches one kernel per row count it sees)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eyas.runtime.linear import MAX_PACKED_ROWS, Linear, PackedLinear, bucketed_rows, pack_linears, row_bucket


@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear_at_every_row_count(bias):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 48, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    layer = Linear(weight, b)
    assert layer.packed is not None or not torch.backends.mkldnn.is_available()
    for rows in [0, 1, 2, 3, 5, 8, 9, 13, 21, 33, 63, 64, 65, 72, 127, 128, 129, 130]:
        x = torch.randn(1, rows, 48, generator=g)
        out = layer(x)
        assert out.shape == (1, rows, 96)
        torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_row_buckets_pad_little_and_stay_few():
    buckets = {row_bucket(r) for r in range(1, MAX_PACKED_ROWS + 1)}
    assert all(row_bucket(r) == r for r in range(1, 9))
    assert all(r <= row_bucket(r) <= 1.25 * r for r in range(1, 4097))
    assert len(buckets) <= 24


def test_a_batch_pads_its_calls_to_a_bucket_by_a_quarter_at_most():
    for calls in range(1, 17):
        for rows in range(1, 129):
            n = bucketed_rows(calls, rows)
            assert rows <= n <= rows + rows // 4
            if n != rows:  # padded: exactly onto a bucket
                assert row_bucket(calls * n) == calls * n <= MAX_PACKED_ROWS
    assert bucketed_rows(1, 13) == 14 and bucketed_rows(8, 5) == 5 and bucketed_rows(1, 200) == 200


def test_packed_linear_serves_and_refuses_training():
    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 8, bias=False))
    x = torch.randn(5, 16)
    with torch.no_grad():
        expected = model(x)
    pack_linears(model)
    assert isinstance(model[0], PackedLinear) and set(model.state_dict()) == {"0.weight", "0.bias", "2.weight"}
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="inference"):
        model(x)
