"""`kv_cache.store` into a pool whose values lie transposed writes what a token-major pool holds."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ocrq.models.hunyuan.kv_cache import store  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_a_transposed_pool_holds_what_a_token_major_pool_holds(dtype: torch.dtype) -> None:
    heads, width, dim = 3, 40, 8
    x = torch.randn(heads, 11, dim)
    columns = torch.tensor([2, 3, 4, 5, 17, 18, 19, 30, 31, 32, 33])
    rows = torch.zeros(1, heads, width, dim, dtype=dtype)
    transposed = torch.zeros(1, heads, dim, width, dtype=dtype).transpose(2, 3)
    store(rows[0], 1, columns, x)
    store(transposed[0], 1, columns, x)
    assert transposed.stride(2) == 1  # still the view the kernel reads
    assert torch.equal(rows.view(torch.uint8), transposed.contiguous().view(torch.uint8))
    assert rows.float()[0, :, columns].ne(0).any()
    untouched = [c for c in range(width) if c not in set(columns.tolist())]
    assert transposed.float()[0, :, untouched].eq(0).all()
