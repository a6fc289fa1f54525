"""The serving linear layers: the same float32 product as F.linear at every row count, and a bounded
set of row buckets (oneDNN caches one kernel per row count it sees)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eyas.runtime.device import resolve_draft_dtype
from eyas.runtime.linear import MAX_PACKED_ROWS, Linear, PackedLinear, bucketed_rows, pack_linears, packs, row_bucket


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


def bf16_products() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_a_bfloat16_linear_goes_through_onednn_where_it_has_bf16_products():
    """A drafter's bfloat16 products on a CPU with bf16 units: oneDNN accumulates in float32, so every row count
    gives the float32 product of the same bfloat16 numbers, rounded once (elsewhere `F.linear`, the same way)."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 48, generator=g).to(torch.bfloat16)
    layer = Linear(weight)
    assert (layer.packed is not None) == packs(torch.bfloat16, torch.device("cpu")) == bf16_products()
    for rows in [1, 2, 5, 8, 13, 64, 129]:
        x = torch.randn(rows, 48, generator=g).to(torch.bfloat16)
        exact = F.linear(x.float(), weight.float())
        out = layer(x)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), exact, rtol=2 ** -7, atol=1e-2)


def test_the_drafter_runs_in_bfloat16_beside_a_float32_target_where_a_cpu_has_bf16_products():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_draft_dtype(None, torch.float32, cpu) == (torch.bfloat16 if bf16_products() else torch.float32)
    assert resolve_draft_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert resolve_draft_dtype("auto", torch.float16, cuda) == torch.float16  # on a GPU: the target's
    assert resolve_draft_dtype("float32", torch.float32, cpu) == torch.float32
    assert resolve_draft_dtype(torch.bfloat16, torch.float32, cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype: 'half'"):
        resolve_draft_dtype("half", torch.float32, cpu)
