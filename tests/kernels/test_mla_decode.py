"""MLA decode (page size 1 and paged, bf16/fp32 and FP8) against the PyTorch references."""

from __future__ import annotations

import math

import pytest
import torch

from engine.kernels.fp8 import quantize_fp8
from engine.kernels.kv_store import store_mla_kv
from engine.kernels.mla_decode import (
    MERGE_PROJECT_MAX_ROWS,
    MERGE_PROJECT_MAX_SPLITS,
    MLADecodeConfig,
    _merge_project,
    merge_project_wanted,
    mla_decode,
    mla_decode_paged,
)
from engine.kernels.reference import mla_decode_paged_ref, mla_decode_ref
from engine.kernels.utils import choose_num_kv_splits, merge_column_chunks, merge_splits

C, R = 64, 16  # kv_lora_rank, rope dim (576 = 512 + 64 on real models)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _pool_inputs(
    seq_lens: list[int], heads: int, dtype: torch.dtype, seed: int, device: torch.device,
    rope: int = R,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    total = sum(seq_lens)
    num_slots = total + 7
    kv = torch.randn(num_slots, 1, C + rope, generator=g).to(dtype)
    kv[0] = 1e4  # slot 0 is the padding sink: reading it would show in the output
    max_reqs, max_ctx = batch + 3, max(seq_lens) + 5
    req_to_token = torch.zeros(max_reqs, max_ctx, dtype=torch.int32)
    slots = torch.randperm(num_slots - 1, generator=g)[:total] + 1
    rows = torch.randperm(max_reqs, generator=g)[:batch]
    off = 0
    for b, n in enumerate(seq_lens):
        req_to_token[rows[b], :n] = slots[off : off + n].int()
        off += n
    q = torch.randn(batch, heads, C + rope, generator=g).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, kv, req_to_token, rows.long(), lens))


@pytest.mark.parametrize(
    "seq_lens,heads,splits",
    [
        ([1], 16, None),  # batch 1, one token
        ([37], 16, 4),  # not a multiple of the tile; some splits hold few tokens
        ([5, 100, 17, 64], 16, None),  # mixed lengths
        ([3, 50], 20, 3),  # heads not a multiple of the head group; empty splits for the short one
        ([33, 70], 4, 8),  # fewer heads than one group
        ([37, 5], 16, 1),  # one split: stage 1 writes the output, no merge
    ],
)
def test_mla_decode_matches_ref(
    seq_lens: list[int], heads: int, splits: int | None, device: torch.device
) -> None:
    q, kv, req_to_token, rows, lens = _pool_inputs(
        seq_lens, heads, torch.float32, seed=len(seq_lens), device=device
    )
    scale = (C + R) ** -0.5
    out = mla_decode(q, kv, req_to_token, rows, lens, C, scale, num_kv_splits=splits)
    ref = mla_decode_ref(q, kv, req_to_token, rows, lens, C, scale)
    assert out.shape == (len(seq_lens), heads, C)
    assert _rel_err(out, ref) < 1e-2  # tl.dot may use tf32


def _small_config(device: torch.device) -> MLADecodeConfig:
    return MLADecodeConfig(16, 32 if device.type == "cuda" else 16, 4, 2)


def test_mla_decode_bf16(device: torch.device) -> None:
    q, kv, req_to_token, rows, lens = _pool_inputs(
        [9, 81], 16, torch.bfloat16, seed=3, device=device
    )
    cfg = _small_config(device)
    out = mla_decode(q, kv, req_to_token, rows, lens, C, 0.1, num_kv_splits=2, config=cfg)
    ref = mla_decode_ref(q, kv, req_to_token, rows, lens, C, 0.1)
    assert out.dtype == torch.bfloat16
    assert _rel_err(out, ref) < 2e-2


@pytest.mark.parametrize(
    "seq_lens,splits",
    [
        ([1, 45, 90], 3),  # mixed lengths; tiles prefetched past a split's end are masked
        ([77], 1),  # one split, several tiles
        ([16, 17], 2),  # a split of exactly one tile, and one of one token
    ],
)
def test_mla_decode_fp8(seq_lens: list[int], splits: int, device: torch.device) -> None:
    q, kv, req_to_token, rows, lens = _pool_inputs(
        seq_lens, 16, torch.float32, seed=5, device=device
    )
    k_scale = torch.tensor([0.02], dtype=torch.float32, device=device)
    kv8 = quantize_fp8(kv, k_scale)
    q = q.to(torch.bfloat16)
    scale = (C + R) ** -0.5
    cfg = _small_config(device)
    out = mla_decode(
        q, kv8, req_to_token, rows, lens, C, scale, k_scale=k_scale, num_kv_splits=splits,
        config=cfg,
    )  # fmt: skip
    ref = mla_decode_ref(q, kv8, req_to_token, rows, lens, C, scale, k_scale=k_scale)
    assert out.dtype == torch.bfloat16
    assert _rel_err(out, ref) < 2e-2


def _decode_forms(
    q: torch.Tensor, kv: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
    lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None, forms: list[MLADecodeConfig],
) -> list[torch.Tensor]:  # fmt: skip
    """The decode output under each config of `forms`, 3 splits each."""
    return [
        mla_decode(
            q,
            kv,
            req_to_token,
            rows,
            lens,
            C,
            scale,
            k_scale=k_scale,
            num_kv_splits=3,
            config=cfg,
        )  # fmt: skip
        for cfg in forms
    ]


@pytest.mark.parametrize("fp8", [False, True])
def test_mla_decode_tile_loading_forms(fp8: bool, device: torch.device) -> None:
    """Page size 1 with the slot ids loaded one tile ahead (the default), with their tile
    (`slots_ahead=0`), and the latent as two halves (`halves`): the same output, mixed
    lengths, several tiles a split."""
    q, kv, req_to_token, rows, lens = _pool_inputs(
        [3, 50, 97], 16, torch.float32, seed=9, device=device
    )
    q, scale = q.to(torch.bfloat16), (C + R) ** -0.5
    k_scale = None
    if fp8:
        k_scale = torch.tensor([0.02], dtype=torch.float32, device=device)
        kv = quantize_fp8(kv, k_scale)
    else:
        kv = kv.to(torch.bfloat16)  # compiled dots take one dtype (the interpreter upcasts)
    base = _small_config(device)
    forms = [
        base._replace(slots_ahead=1),
        base._replace(slots_ahead=0),
        base._replace(halves=True),
    ]
    outs = _decode_forms(q, kv, req_to_token, rows, lens, scale, k_scale, forms)
    ref = mla_decode_ref(q, kv, req_to_token, rows, lens, C, scale, k_scale=k_scale)
    assert _rel_err(outs[0], ref) < 2e-2
    # The same tiles in the same order: the forms agree (bitwise under the interpreter).
    for out in outs[1:]:
        assert _rel_err(out, outs[0]) < 1e-3


@pytest.mark.parametrize("halves", [False, True])
@pytest.mark.parametrize("seq_lens,heads", [([3, 50, 97], 16), ([1, 37], 20)])
def test_mla_decode_fp8_dots(
    halves: bool, seq_lens: list[int], heads: int, device: torch.device
) -> None:
    """QK as an e4m3 dot (q quantized in the kernel, scores transposed; the RoPE part 32 wide,
    the least an e4m3 dot takes), the latent whole or as halves, q as one e4m3 term or two
    (`q_residual`, also through one dot: `q_pairs`): close to the reference within e4m3's
    rounding of q, and the second term brings the output closer to the fp16 dots'."""
    rope = 32
    q, kv, req_to_token, rows, lens = _pool_inputs(
        seq_lens, heads, torch.float32, seed=9, device=device, rope=rope
    )
    q, scale = q.to(torch.bfloat16), (C + rope) ** -0.5
    k_scale = torch.tensor([0.02], dtype=torch.float32, device=device)
    kv8 = quantize_fp8(kv, k_scale)
    base = _small_config(device)._replace(block_n=64 if device.type == "cuda" else 16)
    forms = [
        base._replace(halves=halves),
        base._replace(halves=halves, fp8_dots=True),
        base._replace(halves=halves, fp8_dots=True, q_residual=True),
        base._replace(halves=halves, fp8_dots=True, q_residual=True, q_pairs=True),
    ]
    fp16_dots, one_term, two_terms, paired = _decode_forms(
        q, kv8, req_to_token, rows, lens, scale, k_scale, forms
    )
    ref = mla_decode_ref(q, kv8, req_to_token, rows, lens, C, scale, k_scale=k_scale)
    assert one_term.dtype == torch.bfloat16
    assert _rel_err(fp16_dots, ref) < 1e-2
    # One e4m3 term keeps 3 mantissa bits of q: a few percent, FlashMLA FP8's level
    # (perf/RESULTS.md; the CPU interpreter rounds fp32 -> e4m3 less exactly than the GPU).
    assert _rel_err(one_term, ref) < 8e-2
    assert _rel_err(two_terms, ref) < 0.7 * _rel_err(one_term, ref)
    assert _rel_err(two_terms, fp16_dots) < 3e-2
    # The same sums with the two terms through one dot (`q_pairs`).
    assert _rel_err(paired, two_terms) < 1e-3


def test_mla_decode_fp8_dots_refused(device: torch.device) -> None:
    """An explicit fp8_dots config with a RoPE part narrower than an e4m3 dot takes (16) is
    refused with the reason; the default config falls back to fp16 dots."""
    q, kv, req_to_token, rows, lens = _pool_inputs([20], 16, torch.float32, seed=2, device=device)
    k_scale = torch.tensor([0.02], dtype=torch.float32, device=device)
    kv8 = quantize_fp8(kv, k_scale)
    q = q.to(torch.bfloat16)
    cfg = _small_config(device)._replace(fp8_dots=True)
    with pytest.raises(AssertionError, match="fp8_dots needs"):
        mla_decode(q, kv8, req_to_token, rows, lens, C, 0.1, k_scale=k_scale, config=cfg)
    out = mla_decode(q, kv8, req_to_token, rows, lens, C, 0.1, k_scale=k_scale)
    ref = mla_decode_ref(q, kv8, req_to_token, rows, lens, C, 0.1, k_scale=k_scale)
    assert _rel_err(out, ref) < 2e-2


def test_mla_decode_fp8_large_q(device: torch.device) -> None:
    """q beyond fp16's range is scaled down in the kernel instead of overflowing."""
    q, kv, req_to_token, rows, lens = _pool_inputs([40], 16, torch.float32, seed=8, device=device)
    k_scale = torch.tensor([0.02], dtype=torch.float32, device=device)
    kv8 = quantize_fp8(kv, k_scale)
    q = (q * 2e5).to(torch.bfloat16)
    scale = 1e-6
    out = mla_decode(
        q, kv8, req_to_token, rows, lens, C, scale, k_scale=k_scale, num_kv_splits=1,
        config=_small_config(device),
    )  # fmt: skip
    ref = mla_decode_ref(q, kv8, req_to_token, rows, lens, C, scale, k_scale=k_scale)
    assert torch.isfinite(out.float()).all()
    assert _rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("fp8", [False, True])
def test_mla_decode_paged(fp8: bool, device: torch.device) -> None:
    g = torch.Generator().manual_seed(11)
    page, seq_lens, heads = 16, [1, 16, 47, 100], 16
    max_pages = (max(seq_lens) + page - 1) // page
    num_pages = len(seq_lens) * max_pages + 2
    cache = torch.randn(num_pages, page, 1, C + R, generator=g)
    k_scale = torch.tensor([0.03])
    if fp8:
        cache = quantize_fp8(cache, k_scale)
    block_table = torch.randperm(num_pages, generator=g)[: len(seq_lens) * max_pages]
    block_table = block_table.view(len(seq_lens), max_pages).int()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), heads, C + R, generator=g)
    q, cache, block_table, lens, k_scale = (
        t.to(device) for t in (q, cache, block_table, lens, k_scale)
    )
    if fp8:
        q = q.to(torch.bfloat16)
    ks = k_scale if fp8 else None
    out = mla_decode_paged(
        q, cache, block_table, lens, C, 0.12, k_scale=ks, num_kv_splits=2,
        config=_small_config(device),
    )  # fmt: skip
    ref = mla_decode_paged_ref(q, cache, block_table, lens, C, 0.12, k_scale=ks)
    assert _rel_err(out, ref) < 2e-2


def test_store_then_decode_fp8(device: torch.device) -> None:
    """Rows stored through the FP8 store kernel decode like the unquantized rows (fp8 error)."""
    q, kv, req_to_token, rows, lens = _pool_inputs(
        [30, 66], 16, torch.float32, seed=9, device=device
    )
    k_scale = torch.tensor([kv[1:].abs().max().item() / 448.0], device=device)
    pool = torch.zeros(kv.shape, dtype=torch.float8_e4m3fn, device=device)
    loc = torch.arange(1, kv.shape[0], device=device)
    store_mla_kv(pool, loc, kv[1:, 0], k_scale)
    scale = (C + R) ** -0.5
    out = mla_decode(q.bfloat16(), pool, req_to_token, rows, lens, C, scale, k_scale=k_scale)
    ref = mla_decode_ref(q, kv, req_to_token, rows, lens, C, scale)
    assert _rel_err(out, ref) < (6e-2 if out.is_cuda else 0.15)


def test_choose_num_kv_splits() -> None:
    assert choose_num_kv_splits(1, 16, 16384, sms=132) > 16
    assert choose_num_kv_splits(128, 16, 4096, sms=132) <= 4
    assert choose_num_kv_splits(1, 16, 10, sms=132) == 1


@pytest.mark.parametrize(
    "page,fp8,ahead,halves",
    [
        (16, False, None, False),
        (32, False, None, False),
        (16, True, None, False),
        (16, False, 1, False),
        (16, True, 0, False),
        (32, False, None, True),
        (16, True, None, True),
    ],
)
def test_mla_decode_paged_slots(
    page: int, fp8: bool, ahead: int | None, halves: bool, device: torch.device
) -> None:
    """The engine's paged layout: req_to_token holds every slot, each page's slots consecutive.
    Page ids read with their tile or one tile ahead (`slots_ahead`; None: the default), the
    latent whole or as two halves (`halves`)."""
    g = torch.Generator().manual_seed(page)
    seq_lens, heads = [1, page, 3 * page + 5, 2 * page - 1], 16
    num_pages = sum(-(-n // page) for n in seq_lens) + 3
    kv = torch.randn(num_pages * page, 1, C + R, generator=g)
    kv[:page] = 1e4  # page 0 is the padding page: reading it would show in the output
    k_scale = torch.tensor([0.03])
    if fp8:
        kv = quantize_fp8(kv, k_scale)
    pages = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    rows = torch.tensor([2, 0, 3, 1])
    req_to_token = torch.zeros(4, max(seq_lens) + page, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        own = [pages.pop() for _ in range(-(-n // page))]
        req_to_token[rows[b], :n] = torch.tensor(
            [own[i // page] * page + i % page for i in range(n)]
        )
    q = torch.randn(len(seq_lens), heads, C + R, generator=g)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q, kv, req_to_token, rows, lens, k_scale = (
        t.to(device) for t in (q, kv, req_to_token, rows, lens, k_scale)
    )
    ks = k_scale if fp8 else None
    if fp8:
        q = q.to(torch.bfloat16)
    out = mla_decode(
        q, kv, req_to_token, rows, lens, C, 0.1, k_scale=ks, num_kv_splits=3, page_size=page,
        config=_small_config(device)._replace(slots_ahead=ahead, halves=halves),
    )  # fmt: skip
    ref = mla_decode_ref(q, kv, req_to_token, rows, lens, C, 0.1, k_scale=ks)
    assert _rel_err(out, ref) < 2e-2


@pytest.mark.parametrize(
    "seq_lens,splits,dtype",
    [
        ([37], 4, torch.float32),  # batch 1: the merge and W_UV in one kernel
        ([37], 4, torch.bfloat16),
        ([200, 3, 4], 40, torch.float32),  # many splits, most of them empty
        ([200, 3, 64], 64, torch.float32),  # a graph's split count: the merge, then the GEMM
        ([9, 81], 1, torch.float32),  # one split: stage 1's output through the small GEMM
        ([5 + 7 * i for i in range(10)], 3, torch.bfloat16),  # past the fused kernel's rows
        ([5 + 3 * i for i in range(20)], 2, torch.float32),  # past the small GEMM's: bmm
    ],
)
def test_mla_decode_value_proj(
    seq_lens: list[int], splits: int, dtype: torch.dtype, device: torch.device
) -> None:
    """With W_UV given, the output is the attention output times it per head."""
    heads, v = 16, 24  # v not a multiple of the kernel's value slice
    q, kv, req_to_token, rows, lens = _pool_inputs(
        seq_lens, heads, dtype, seed=len(seq_lens) + splits, device=device
    )
    g = torch.Generator().manual_seed(2)
    w_uv = (torch.randn(heads, v, C, generator=g) / C**0.5).to(dtype).to(device)
    w = w_uv.transpose(1, 2)  # [H, C, V], a strided view as the layer passes it
    scale = (C + R) ** -0.5
    cfg = _small_config(device)
    out = mla_decode(
        q, kv, req_to_token, rows, lens, C, scale, num_kv_splits=splits, config=cfg,
        value_proj=w,
    )  # fmt: skip
    attn = mla_decode_ref(q, kv, req_to_token, rows, lens, C, scale)
    ref = torch.einsum("bhc,hcv->bhv", attn.float(), w.float())
    assert out.shape == (len(seq_lens), heads, v) and out.dtype == dtype
    assert _rel_err(out, ref) < (2e-2 if dtype == torch.bfloat16 else 1e-2)


def test_merge_project_wanted() -> None:
    """One kernel for the merge and W_UV at few rows, heads and splits; past any limit two."""
    assert merge_project_wanted(1, 16, 8)
    assert merge_project_wanted(MERGE_PROJECT_MAX_ROWS, 16, MERGE_PROJECT_MAX_SPLITS)
    assert not merge_project_wanted(1, 16, 1)  # nothing to merge
    assert not merge_project_wanted(1, 16, 64)  # batch 1 at ctx 16K: the merge cut by columns
    assert not merge_project_wanted(MERGE_PROJECT_MAX_ROWS + 1, 16, 8)
    assert not merge_project_wanted(1, 128, 8)


def test_merge_inside_fits() -> None:
    """Stage 1 merges its own splits only with 2-16 of them and a grid within the SMs."""
    from engine.kernels.mla_decode import MERGE_INSIDE_MAX_SPLITS, merge_inside_fits

    assert merge_inside_fits(8, 128, sms=132)  # batch 16, 8 splits
    assert merge_inside_fits(2, 132, sms=132)
    assert not merge_inside_fits(1, 64, sms=132)  # nothing to merge
    assert not merge_inside_fits(3, 150, sms=132)  # not all resident at once: they could hang
    assert not merge_inside_fits(MERGE_INSIDE_MAX_SPLITS + 1, 17, sms=132)
    assert not merge_inside_fits(64, 64, sms=132)  # batch 1 at 64 splits: slower inside


def test_gluon_merge_shape() -> None:
    """The programs that merge inside the Gluon kernel: a power of two, no more than the splits,
    at least 8 columns each; the splits padded to a power of two."""
    from engine.kernels.mla_decode_gluon import merge_shape

    assert merge_shape(2, 512) == (2, 2)
    assert merge_shape(3, 512) == (2, 4)
    assert merge_shape(8, 512) == (8, 8)
    assert merge_shape(33, 512) == (32, 64)
    assert merge_shape(64, 512) == (64, 64)
    assert merge_shape(64, 256) == (32, 64)  # 8 columns a program at the least
    for splits in range(2, 65):
        chunks, s_pad = merge_shape(splits, 512)
        assert chunks & (chunks - 1) == 0 and chunks <= splits <= s_pad < 2 * splits
        assert 512 // chunks >= 8


def test_merge_column_chunks() -> None:
    """Fewer rows than SMs cut into column chunks (at least 64 columns) until about one
    program an SM."""
    assert merge_column_chunks(16, 512, sms=132) == 8  # batch 1, 16 heads: 128 programs
    assert merge_column_chunks(64, 512, sms=132) == 4
    assert merge_column_chunks(128, 512, sms=132) == 2
    assert merge_column_chunks(256, 512, sms=132) == 1
    assert merge_column_chunks(4, 128, sms=132) == 2  # never below 64 columns
    assert merge_column_chunks(4, 96, sms=132) == 1  # 48 columns: not cut


# 8 column chunks a row, one (192 rows), and 2 of a GQA head's 128 columns
@pytest.mark.parametrize(("heads", "width"), [(2, 512), (64, 512), (2, 128)])
def test_merge_splits_in_chunks(device: torch.device, heads: int, width: int) -> None:
    """Splits read several chunks a row (512 wide: 16 a load), empty ones (-inf) skipped; the
    merge alone and merged with the value projection, against torch."""
    g = torch.Generator().manual_seed(4)
    batch, splits, v = 3, 40, 16
    mid_o = torch.randn(batch, heads, splits, width, generator=g)
    lse = torch.randn(batch, heads, splits, generator=g) * 3
    for b, nonempty in enumerate([40, 17, 1]):  # all, past one chunk, only the first
        lse[b, :, nonempty:] = float("-inf")
        mid_o[b, :, nonempty:] = float("nan")  # never read
    w = torch.randn(heads, width, v, generator=g) / width**0.5
    share = torch.softmax(lse * math.log(2), dim=-1)  # lse is in log2 units
    ref = torch.einsum("bhs,bhsc->bhc", share, torch.nan_to_num(mid_o))
    mid_o, lse, w = mid_o.to(device), lse.to(device), w.to(device)
    out = torch.empty(batch, heads, width, device=device)
    merge_splits(mid_o, lse, out)
    assert _rel_err(out.cpu(), ref) < 1e-5
    y = torch.empty(batch, heads, v, device=device)
    _merge_project(mid_o, lse, w, y)
    assert _rel_err(y.cpu(), torch.einsum("bhc,hcv->bhv", ref, w.cpu())) < 1e-5
