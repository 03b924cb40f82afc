"""The running loop's KV pool dtype: the model's own, or fp8 (e4m3) to halve what a step reads.

Why fp8: on an H200 a decode step of A4 pages is bound by reading the KV pool. 176 live rows of
~2,800 cached tokens at 96 KiB a token are ~47 GB a step, and 4,959 steps of 13.9 ms made 89 of a
page's 143 ms (bench/results/service_gpu/service_gpu_reading.md, "A4 pages alone"). One byte a value
instead of two halves that read and doubles the rows a pool of the same bytes holds.

How: no scale, as vLLM's fp8 KV cache runs without calibrated scales. e4m3 keeps 3 mantissa bits
and a range of +-448. HunYuan's keys leave a per-head RMSNorm (the key layernorm), so their size
is the norm's weight; values are not normalised, and saturate at +-448 instead of becoming NaN
(`to_cache` clamps; the fused decode kernel clamps the same way). The loop writes every key and
value through these, and the decode attention widens them back to the model's dtype as it loads
them, so only storage changes: the arithmetic stays bf16/fp32. The error this costs is measured
against the model's dtype (bench/continuous_batching.py `--kv-dtypes`; tests on the CPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, get_args

from ocrq.core.settings import KvCacheDtype

if TYPE_CHECKING:
    import torch

KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def kv_dtype(name: str, model_dtype: Any) -> Any:
    """The torch dtype of a pool: "auto" is the model's."""
    import torch

    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv cache dtype must be one of {KV_CACHE_DTYPES}, not {name!r}")
    return model_dtype if name == "auto" else torch.float8_e4m3fn


def is_fp8(dtype: Any) -> bool:
    import torch

    return dtype == torch.float8_e4m3fn


def to_cache(x: torch.Tensor, dtype: Any) -> torch.Tensor:
    """`x` as the pool stores it: unchanged in its own dtype, saturated into fp8."""
    if x.dtype == dtype:
        return x
    if is_fp8(dtype):
        return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def padded_width(columns: int, pad: int) -> int:
    """A pool's width for `columns` written ones and `pad` readable past them, rounded up to a
    multiple of 128: each value row of a transposed pool then starts 16-byte aligned."""
    return -(-(columns + pad) // 128) * 128


def zero_pool(kv_heads: int, width: int, head_dim: int, dtype: Any, device: Any,
              transposed: bool = False) -> torch.Tensor:
    """A zeroed (1, KV heads, width, D) pool; `transposed`: laid out (1, KV heads, D, width)
    in memory, the running loop's fp8 values (ocrq/models/hunyuan/running.py)."""
    import torch

    if transposed:
        return torch.zeros(1, kv_heads, head_dim, width, dtype=dtype,
                           device=device).transpose(2, 3)
    return torch.zeros(1, kv_heads, width, head_dim, dtype=dtype, device=device)


def store(pool: torch.Tensor, dim: int, index: torch.Tensor, x: torch.Tensor) -> None:
    """`pool.index_copy_(dim, index, x)` with `x` converted as the pool stores it. An fp8 pool
    is copied into as bytes: torch has no fp8 `index_copy_` on the CPU.

    A pool whose indexed dim is its innermost in memory (the running loop's transposed fp8
    values: (heads, tokens, D) viewed over (heads, D, tokens)) is written through the view that
    matches memory, from `x` laid out the same way, so a copy's neighbouring threads write
    neighbouring bytes; indexed as the view reads, each byte went to its own place a pool width
    apart. One layer's values of a four-page prefill pass on an H200: 111 us this way, 185 us
    that way, 56 us into a token-major pool (bench/results/kv_attention/kv_store_h200.md)."""
    import torch

    x = to_cache(x, pool.dtype)
    last = pool.dim() - 1
    if dim != last and pool.stride(dim) == 1 and pool.stride(last) != 1:
        pool, x, dim = pool.transpose(dim, last), x.transpose(dim, last).contiguous(), last
    if is_fp8(pool.dtype):
        pool.view(torch.uint8).index_copy_(dim, index, x.view(torch.uint8))
    else:
        pool.index_copy_(dim, index, x)


def bytes_ratio(name: str, model_dtype: Any) -> float:
    """A pool token's bytes in this dtype over the model dtype's (the cost model's unit)."""
    return float(kv_dtype(name, model_dtype).itemsize) / float(model_dtype.itemsize)
