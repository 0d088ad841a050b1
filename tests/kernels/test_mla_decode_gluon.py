"""The warp-specialized Gluon FP8 MLA decode kernel (`engine.kernels.mla_decode_gluon`) against
the torch reference, on a Hopper GPU (Gluon compiles for the GPU only; CPU runs take the Triton
kernel, tested in test_mla_decode.py). DeepSeek's shape: latent 512, RoPE 64."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.fp8 import quantize_fp8
from engine.kernels.mla_decode import (
    MLADecodeConfig,
    default_config,
    gluon_config,
    mla_decode,
    mla_decode_paged,
)
from engine.kernels.mla_decode_gluon_wide import BLOCK_H
from engine.kernels.reference import mla_decode_paged_ref, mla_decode_ref

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs a Hopper GPU (sm_90)",
    ),
]

C, R = 512, 64
K_SCALE = 0.02


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _gluon(
    stages: int = 2, v_stages: int = 2, q_residual: bool = True, v_rows: int = 64
) -> MLADecodeConfig:
    return MLADecodeConfig(
        16, 64, 4, stages, 1.0, 128, q_residual=q_residual, gluon=v_stages, v_rows=v_rows
    )


def _pool(
    seq_lens: list[int], heads: int, seed: int, fp8: bool = True, c: int = C
) -> tuple[torch.Tensor, ...]:
    """An e4m3 pool (bf16 with `fp8=False`) with each request's tokens at random slots (slot 0,
    the padding sink, holds large values: reading it would show), req_to_token rows in random
    order, bf16 q."""
    g = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    kv = torch.randn(total + 9, 1, c + R, generator=g)
    kv[0] = 8.0
    kv8 = quantize_fp8(kv, torch.tensor([K_SCALE])) if fp8 else kv.to(torch.bfloat16)
    max_reqs = len(seq_lens) + 2
    req_to_token = torch.zeros(max_reqs, max(seq_lens) + 3, dtype=torch.int32)
    slots = torch.randperm(total + 8, generator=g)[:total] + 1
    rows = torch.randperm(max_reqs, generator=g)[: len(seq_lens)]
    off = 0
    for b, n in enumerate(seq_lens):
        req_to_token[rows[b], :n] = slots[off : off + n].int()
        off += n
    q = torch.randn(len(seq_lens), heads, c + R, generator=g).to(torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    k_scale = torch.tensor([K_SCALE])
    return tuple(t.cuda() for t in (q, kv8, req_to_token, rows.long(), lens, k_scale))


@pytest.mark.parametrize(
    "seq_lens,heads,splits",
    [
        ([1], 16, None),  # one token: one tile, 63 rows masked
        ([37, 64, 65], 16, 1),  # one split (stage 1 writes the output); a tile edge
        ([5, 1000, 17, 300], 16, None),  # mixed lengths, the default split count
        ([3, 200], 20, 8),  # two head groups, the second mostly masked; empty splits
        ([130, 7], 128, 3),  # DeepSeek-V3's heads (eight groups)
        ([4100], 16, 2),  # many tiles a split: the rings wrap many times
    ],
)
def test_gluon_matches_reference(seq_lens: list[int], heads: int, splits: int | None) -> None:
    q, kv8, req_to_token, rows, lens, k_scale = _pool(seq_lens, heads, seed=len(seq_lens))
    scale = (C + R) ** -0.5
    ref = mla_decode_ref(q, kv8, req_to_token, rows, lens, C, scale, k_scale=k_scale)
    out = mla_decode(
        q, kv8, req_to_token, rows, lens, C, scale, k_scale=k_scale, num_kv_splits=splits,
        config=_gluon(),
    )  # fmt: skip
    assert out.shape == (len(seq_lens), heads, C) and out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()
    # Two e4m3 terms of q: the error is about that of the fp16 dots (bf16 output, fp16 P).
    assert _rel_err(out, ref) < 2e-2
    one_term = mla_decode(
        q, kv8, req_to_token, rows, lens, C, scale, k_scale=k_scale, num_kv_splits=splits,
        config=_gluon(q_residual=False),
    )  # fmt: skip
    assert _rel_err(one_term, ref) < 8e-2
    if max(seq_lens) > 1:  # (one token: the output is its V row, whatever the scores)
        assert _rel_err(out, ref) < _rel_err(one_term, ref)


@pytest.mark.parametrize(
    "seq_lens,heads,splits",
    [([37, 300], 32, None), ([130, 7], 128, 3), ([3, 200], 40, 8), ([1], 16, None)],
)
def test_gluon_32_heads_a_program(seq_lens: list[int], heads: int, splits: int | None) -> None:
    """`gluon_heads=32` (m64n64 QK, m64n32 PV): the torch reference's answer and the 16-head
    form's error; 40 heads leave the second group mostly masked, 16 heads half of the one."""
    q, kv8, req_to_token, rows, lens, k_scale = _pool(seq_lens, heads, seed=heads)
    scale = (C + R) ** -0.5
    args = (q, kv8, req_to_token, rows, lens, C, scale)
    ref = mla_decode_ref(*args, k_scale=k_scale)
    cfg = _gluon(3, 2, v_rows=32)._replace(gluon_heads=32)
    out = mla_decode(*args, k_scale=k_scale, num_kv_splits=splits, config=cfg)
    base = mla_decode(*args, k_scale=k_scale, num_kv_splits=splits, config=_gluon())
    assert out.shape == (len(seq_lens), heads, C) and torch.isfinite(out.float()).all()
    assert _rel_err(out, ref) < 2e-2
    # The same products over the same q terms: only the heads' grouping differs.
    assert _rel_err(out, base) < 1e-2


@pytest.mark.parametrize(
    "stages,v_stages,v_rows,q_residual",
    [
        (2, 1, 64, True),
        (3, 1, 64, True),
        (2, 2, 64, True),
        (3, 3, 32, True),
        (4, 3, 16, True),
        # (4 e4m3 tiles and 2 V slots of 32 fit only with q as one term: 233 KB with two.)
        (4, 2, 32, False),
    ],
)
def test_gluon_ring_depths_agree(stages: int, v_stages: int, v_rows: int, q_residual: bool) -> None:
    """The ring depths and V slot size change only the overlap: the same products, accumulated
    in the same order (PV's k-steps of 16 tokens run in token order however the slots cut)."""
    q, kv8, req_to_token, rows, lens, k_scale = _pool([700, 90], 16, seed=5)
    args = (q, kv8, req_to_token, rows, lens, C, 0.05)
    cfgs = (_gluon(q_residual=q_residual), _gluon(stages, v_stages, q_residual, v_rows))
    outs = [mla_decode(*args, k_scale=k_scale, num_kv_splits=2, config=cfg) for cfg in cfgs]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(
    "seq_lens,heads,splits",
    [
        ([1], 16, None),  # one token: P is 1 (exact in e4m3), the output its V row
        ([37, 64, 65], 16, 1),
        ([5, 1000, 17, 300], 16, None),
        ([3, 200], 20, 8),  # a mostly masked second head group; empty splits
        ([4100], 16, 2),  # the V^T ring wraps many times
    ],
)
@pytest.mark.parametrize("q_residual", [True, False])
def test_gluon_e4m3_pv_matches_reference(
    seq_lens: list[int], heads: int, splits: int | None, q_residual: bool
) -> None:
    """PV as an e4m3 wgmma over V transposed in e4m3 (`pv_e4m3`): the torch reference's answer
    within the error P's e4m3 rounding adds to the fp16-PV form's (FlashMLA FP8 rounds P
    alike), and close to that form itself. A wrong V^T layout, token order or row order
    would show as an O(1) error."""
    q, kv8, req_to_token, rows, lens, k_scale = _pool(seq_lens, heads, seed=len(seq_lens) + 7)
    args = (q, kv8, req_to_token, rows, lens, C, (C + R) ** -0.5)
    ref = mla_decode_ref(*args, k_scale=k_scale)
    cfg = _gluon(q_residual=q_residual)
    base = mla_decode(*args, k_scale=k_scale, num_kv_splits=splits, config=cfg)
    out = mla_decode(
        *args, k_scale=k_scale, num_kv_splits=splits, config=cfg._replace(pv_e4m3=True)
    )
    assert out.shape == (len(seq_lens), heads, C) and torch.isfinite(out.float()).all()
    limit = 2e-2 if q_residual else 8e-2
    assert _rel_err(out, ref) < limit + 1.5e-2
    assert _rel_err(out, base) < 2.5e-2
    if max(seq_lens) == 1:
        assert _rel_err(out, base) < 1e-2


@pytest.mark.parametrize(
    "seq_lens,heads,splits,stages,c",
    [
        ([1], 16, None, 2, C),  # one token: one tile, 63 rows masked
        ([37, 64, 65], 16, 1, 3, C),  # one split (stage 1 writes the output); a tile edge
        ([5, 1000, 17, 300], 16, None, 4, C),
        ([3, 200], 20, 8, 5, C),  # a mostly masked second head group; empty splits
        ([4100], 16, 2, 5, C),  # the ring wraps many times
        ([700, 90], 16, 2, 4, 256),  # a latent of 256: 8 columns a thread
    ],
)
def test_gluon_pv_regs(
    seq_lens: list[int], heads: int, splits: int | None, stages: int, c: int
) -> None:
    """PV with V^T from registers (`pv_regs`): the torch reference's answer, and the same
    products as the converter form (fp16 V, the same tokens a k-step in the same order), so
    its output up to the order of the softmax's sums (kept per thread, summed across the
    warps at the end: `_tile_softmax`)."""
    q, kv8, req_to_token, rows, lens, k_scale = _pool(seq_lens, heads, seed=stages, c=c)
    args = (q, kv8, req_to_token, rows, lens, c, (c + R) ** -0.5)
    ref = mla_decode_ref(*args, k_scale=k_scale)
    base = mla_decode(*args, k_scale=k_scale, num_kv_splits=splits, config=_gluon())
    cfg = _gluon(stages, 1)._replace(pv_regs=True)
    out = mla_decode(*args, k_scale=k_scale, num_kv_splits=splits, config=cfg)
    assert out.shape == (len(seq_lens), heads, c) and torch.isfinite(out.float()).all()
    assert _rel_err(out, ref) < 2e-2
    assert _rel_err(out, base) < 1e-3


@pytest.mark.parametrize(
    "seq_lens,heads,splits,stages,c,q_gain",
    [
        ([1], 16, None, 2, C, 1.0),  # one token: P is 1 (exact in e4m3), the output its V row
        ([37, 64, 65], 16, 1, 3, C, 1.0),  # one split (stage 1 writes the output); a tile edge
        ([5, 1000, 17, 300], 16, None, 4, C, 1.0),
        ([3, 200], 20, 8, 5, C, 1.0),  # a mostly masked second head group; empty splits
        ([4100], 16, 2, 4, C, 1.0),  # the ring wraps many times
        ([300, 77], 16, None, 4, C, 6.0),  # sharp scores: P far from uniform inside a tile
        ([700, 90], 16, 2, 4, 256, 1.0),  # a latent of 256
    ],
)
def test_gluon_pv_regs_e4m3(
    seq_lens: list[int], heads: int, splits: int | None, stages: int, c: int, q_gain: float
) -> None:
    """PV as e4m3 wgmmas with V^T from registers (`pv_regs` with `pv_e4m3`): the same P (e4m3,
    times P_SCALE) and V bytes as the transposer's e4m3 form, summed in another order, so
    its output up to the sums' order and bf16 rounding; within P's rounding of the
    reference. A wrong token order between V and P (`_k8_order`) or a wrong row order would
    show as an O(1) error (a token order wrong in one tile of 16 as about 6e-2)."""
    q, kv8, req_to_token, rows, lens, k_scale = _pool(seq_lens, heads, seed=stages + 11, c=c)
    q = q * q_gain
    args = (q, kv8, req_to_token, rows, lens, c, (c + R) ** -0.5)
    ref = mla_decode_ref(*args, k_scale=k_scale)
    cfg = _gluon(stages, 1)._replace(pv_regs=True, pv_e4m3=True)
    out = mla_decode(*args, k_scale=k_scale, num_kv_splits=splits, config=cfg)
    assert out.shape == (len(seq_lens), heads, c) and torch.isfinite(out.float()).all()
    assert _rel_err(out, ref) < 3.5e-2
    if c == C:  # (the transposer's form serves a latent of 512)
        conv = _gluon()._replace(pv_e4m3=True)
        other = mla_decode(*args, k_scale=k_scale, num_kv_splits=splits, config=conv)
        assert _rel_err(out, other) < 1e-3
    if max(seq_lens) == 1:
        fp16 = mla_decode(*args, k_scale=k_scale, num_kv_splits=splits, config=_gluon())
        assert _rel_err(out, fp16) < 1e-2


@pytest.mark.parametrize("seq_lens,c", [([5, 1000, 17, 300], C), ([700, 90], 256)])
def test_gluon_pv_regs_wide_values(seq_lens: list[int], c: int) -> None:
    """The register-V form's conversion (bytes paired by PRMT, then converted: `_PAIRS_CVT`)
    over cache values of 13 binades, both signs, e4m3's subnormals among them: the converter
    form's answer."""
    q, kv8, req_to_token, rows, lens, k_scale = _pool(seq_lens, 16, seed=len(seq_lens), c=c)
    wide = torch.randn(kv8[1:].shape, device=kv8.device)
    wide = wide * 2.0 ** torch.randint(-10, 3, wide.shape, device=kv8.device)
    kv8[1:] = wide.to(kv8.dtype)  # slot 0, the padding sink, kept
    args = (q, kv8, req_to_token, rows, lens, c, (c + R) ** -0.5)
    ref = mla_decode_ref(*args, k_scale=k_scale)
    base = mla_decode(*args, k_scale=k_scale, config=_gluon())
    out = mla_decode(*args, k_scale=k_scale, config=_gluon(4, 1)._replace(pv_regs=True))
    assert torch.isfinite(out.float()).all()
    assert _rel_err(out, ref) < 2e-2
    assert _rel_err(out, base) < 1e-3


@pytest.mark.parametrize(
    "seq_lens,splits,form",
    [
        ([1], None, "regs"),  # one tile: the ids of two tiles past the end, all masked
        ([37, 64, 65, 129], 1, "regs"),  # tile edges; 2-3 tiles a request
        ([5, 1000, 17, 300], None, "conv"),  # the converter form's loader is the same
        ([4100, 90], 2, "regs"),  # the ring wraps many times
        ([700, 90], 3, "bf16"),  # a bf16 pool (no converter)
    ],
)
def test_gluon_slot_ids_two_tiles_ahead(seq_lens: list[int], splits: int | None, form: str) -> None:
    """`slots_ahead` 2 (the loader reads the slot ids two tiles ahead, two a lane): the same
    rows into the same ring slots as one tile ahead, so the same output bit for bit."""
    q, kv, req_to_token, rows, lens, k_scale = _pool(seq_lens, 16, seed=3, fp8=form != "bf16")
    args = (q, kv, req_to_token, rows, lens, C, (C + R) ** -0.5)
    if form == "bf16":
        k_scale, cfg = None, BF16_16
    else:
        # (the converter form as the engine runs it: 3 e4m3 tiles, V in 3 slots of 32 tokens)
        cfg = _gluon(4, 1)._replace(pv_regs=True) if form == "regs" else _gluon(3, 3, v_rows=32)
    one = mla_decode(*args, k_scale=k_scale, num_kv_splits=splits, config=cfg)
    two = mla_decode(
        *args, k_scale=k_scale, num_kv_splits=splits, config=cfg._replace(slots_ahead=2)
    )
    assert torch.isfinite(two.float()).all()
    assert torch.equal(one, two)
    ref = mla_decode_ref(*args, k_scale=k_scale)
    assert _rel_err(two, ref) < 2e-2


@pytest.mark.parametrize("warps", [2, 4])
@pytest.mark.parametrize("form", ["regs", "regs8", "conv", "bf16"])
def test_gluon_loader_warps(warps: int, form: str) -> None:
    """`loader_warps` 2 or 4 (the tile's rows shared among the loader's warps): the same rows
    into the same ring slots as one warp, so the same output bit for bit, with ring wraps, a
    request shorter than a tile and one that ends mid-tile."""
    q, kv, req_to_token, rows, lens, k_scale = _pool(
        [4100, 90, 5, 777], 16, seed=5, fp8=form != "bf16"
    )
    args = (q, kv, req_to_token, rows, lens, C, (C + R) ** -0.5)
    if form == "bf16":
        k_scale, cfg = None, BF16_16
    elif form == "conv":
        cfg = _gluon(3, 3, v_rows=32)
    else:
        cfg = _gluon(4, 1)._replace(pv_regs=True, pv_e4m3=form == "regs8")
    one = mla_decode(*args, k_scale=k_scale, config=cfg)
    more = mla_decode(*args, k_scale=k_scale, config=cfg._replace(loader_warps=warps))
    assert torch.isfinite(more.float()).all()
    assert torch.equal(one, more)
    bound = 3.5e-2 if form == "regs8" else 2e-2  # (P in e4m3, as test_gluon_pv_regs_e4m3)
    assert _rel_err(more, mla_decode_ref(*args, k_scale=k_scale)) < bound


def test_gluon_matches_triton_kernel() -> None:
    """Against the Triton FP8 kernel's default (q as two e4m3 terms through one dot)."""
    q, kv8, req_to_token, rows, lens, k_scale = _pool([2000, 333, 64], 16, seed=7)
    args = (q, kv8, req_to_token, rows, lens, C, 0.04)
    triton_out = mla_decode(*args, k_scale=k_scale, config=default_config(16, True))
    out = mla_decode(*args, k_scale=k_scale, config=_gluon())
    assert _rel_err(out, triton_out) < 1e-2


@pytest.mark.parametrize("pv_e4m3,pv_regs", [(False, False), (True, False), (False, True)])
def test_gluon_paged(pv_e4m3: bool, pv_regs: bool) -> None:
    """FlashMLA's paged layout (page 64, a block table), with a request ending mid-page; PV in
    fp16 (V from the fp16 ring or, `pv_regs`, from registers) or (`pv_e4m3`) in e4m3."""
    g = torch.Generator().manual_seed(3)
    page, seq_lens, heads = 64, [1, 64, 130, 1000], 16
    max_pages = (max(seq_lens) + page - 1) // page
    num_pages = len(seq_lens) * max_pages + 1
    cache = quantize_fp8(torch.randn(num_pages, page, 1, C + R, generator=g), torch.tensor([0.03]))
    block_table = torch.randperm(num_pages, generator=g)[: len(seq_lens) * max_pages]
    block_table = block_table.view(len(seq_lens), max_pages).int()
    q = torch.randn(len(seq_lens), heads, C + R, generator=g).to(torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    k_scale = torch.tensor([0.03])
    q, cache, block_table, lens, k_scale = (
        t.cuda() for t in (q, cache, block_table, lens, k_scale)
    )
    ref = mla_decode_paged_ref(q, cache, block_table, lens, C, 0.05, k_scale=k_scale)
    cfg = _gluon(4 if pv_regs else 2)._replace(pv_e4m3=pv_e4m3, pv_regs=pv_regs)
    out = mla_decode_paged(
        q, cache, block_table, lens, C, 0.05, k_scale=k_scale, num_kv_splits=3, config=cfg
    )
    assert _rel_err(out, ref) < (3.5e-2 if pv_e4m3 else 2e-2)


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize(
    "seq_lens,heads,splits,max_splits",
    [
        ([700, 3, 129], 16, 2, None),
        ([2000], 16, 3, None),  # a split count that is no power of two: 2 programs merge
        ([900, 60], 20, 8, None),  # two head groups, the second mostly masked; empty splits
        ([5000], 16, 16, None),  # the most splits merged inside by default
        ([5000], 16, 33, None),  # past MERGE_INSIDE_MAX_SPLITS: merged apart
        ([5000], 16, 33, 64),  # the kernel itself: 32 programs merge 16 columns each
        ([300], 16, 64, 64),  # most splits empty, as in a graph sized for long contexts
        ([64] * 40, 16, 3, None),  # 120 programs: within 132 SMs
        ([64] * 50, 16, 3, None),  # 150 programs: more than the SMs, merged apart
    ],
)
def test_gluon_merge_inside(
    seq_lens: list[int],
    heads: int,
    splits: int,
    max_splits: int | None,
    fp8: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The split merge inside stage 1 (`_merge_here`) gives the merge after it (`merge_splits`),
    leaves its counters at zero, and is taken only where the grid fits the SMs and the splits
    are few; each program's merge covers one 2-64 column slice (`merge_shape`)."""
    from engine.kernels import mla_decode as md
    from engine.kernels.mla_decode_gluon import merge_counters

    q, kv, req_to_token, rows, lens, k_scale = _pool(seq_lens, heads, seed=splits, fp8=fp8)
    args = (q, kv, req_to_token, rows, lens, C, (C + R) ** -0.5)
    cfg = _gluon() if fp8 else BF16_16
    k = k_scale if fp8 else None
    if max_splits is not None:
        monkeypatch.setattr(md, "MERGE_INSIDE_MAX_SPLITS", max_splits)
    merges: list[int] = []
    real_merge = md.merge_splits
    monkeypatch.setattr(md, "merge_splits", lambda *a: merges.append(1) or real_merge(*a))
    apart = mla_decode(*args, k_scale=k, num_kv_splits=splits, config=cfg)
    assert len(merges) == 1 and not cfg.merge_inside  # (not the engine's pick: run AS)
    cfg = cfg._replace(merge_inside=True)
    inside = mla_decode(*args, k_scale=k, num_kv_splits=splits, config=cfg)
    programs = len(seq_lens) * -(-heads // 16) * splits
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fits = programs <= sms and splits <= md.MERGE_INSIDE_MAX_SPLITS
    assert len(merges) == (1 if fits else 2)
    assert _rel_err(inside, apart) < 2e-3
    counters = merge_counters(q.device)
    assert counters is not None and not counters.any()
    for _ in range(3):  # the same answer each launch: the counters were left as found
        again = mla_decode(*args, k_scale=k, num_kv_splits=splits, config=cfg)
        assert torch.equal(again, inside)
    ref = mla_decode_ref(*args, k_scale=k)
    assert _rel_err(inside, ref) < (2e-2 if fp8 else 1e-2)


def test_gluon_value_proj() -> None:
    """With MLA's W_UV the merged output is projected per head (at batch <= 4 in one launch
    with the merge)."""
    q, kv8, req_to_token, rows, lens, k_scale = _pool([300, 40], 16, seed=11)
    w = torch.randn(16, C, 128, device="cuda", dtype=torch.bfloat16) * 0.05
    out = mla_decode(
        q, kv8, req_to_token, rows, lens, C, 0.05, k_scale=k_scale, config=_gluon(), value_proj=w
    )
    ref = mla_decode_ref(q, kv8, req_to_token, rows, lens, C, 0.05, k_scale=k_scale)
    ref = torch.einsum("bhc,hcv->bhv", ref.float(), w.float())
    assert _rel_err(out, ref) < 2e-2


# The bf16 kernel of 64 heads a program (`mla_decode_gluon_wide`): V's columns split over two
# warp groups, P handed from one to the other through shared memory.
WIDE = MLADecodeConfig(BLOCK_H.value, 64, 4, 2, 1.0, 128, gluon=1, gluon_heads=BLOCK_H.value)


@pytest.mark.parametrize(
    "seq_lens,heads,splits",
    [
        ([1], 64, None),  # one token: one tile, 63 rows masked
        ([37, 64, 65], 128, 1),  # one split (stage 1 writes the output); a tile edge
        ([5, 1000, 17, 300], 128, None),  # mixed lengths, the default split count
        ([3, 200], 80, 8),  # the second head group mostly masked; empty splits
        ([4100], 64, 2),  # many tiles a split: the ring and the P hand-over wrap many times
    ],
)
def test_gluon_wide_matches_reference(seq_lens: list[int], heads: int, splits: int | None) -> None:
    _check_bf16(seq_lens, heads, splits, WIDE, seed=heads)


def _check_bf16(
    seq_lens: list[int], heads: int, splits: int | None, cfg: MLADecodeConfig, seed: int
) -> None:
    """A Gluon kernel over a bf16 pool against the fp32 torch reference (bf16 P and output)
    and the Triton kernel's own answer."""
    q, kv, req_to_token, rows, lens, _ = _pool(seq_lens, heads, seed=seed, fp8=False)
    args = (q, kv, req_to_token, rows, lens, C, (C + R) ** -0.5)
    ref = mla_decode_ref(*args)
    out = mla_decode(*args, num_kv_splits=splits, config=cfg)
    assert out.shape == (len(seq_lens), heads, C) and out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()
    assert _rel_err(out, ref) < 1e-2
    triton_out = mla_decode(*args, num_kv_splits=splits, config=default_config(heads, False))
    assert _rel_err(out, triton_out) < 1e-2


def test_gluon_wide_paged() -> None:
    """Pages of 64 with a block table, a request ending mid-page, the default split count."""
    _check_bf16_paged(WIDE, heads=128, seed=4)


def _check_bf16_paged(cfg: MLADecodeConfig, heads: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    page, seq_lens = 64, [1, 64, 130, 1000]
    max_pages = (max(seq_lens) + page - 1) // page
    num_pages = len(seq_lens) * max_pages + 1
    cache = torch.randn(num_pages, page, 1, C + R, generator=g).to(torch.bfloat16)
    block_table = torch.randperm(num_pages, generator=g)[: len(seq_lens) * max_pages]
    block_table = block_table.view(len(seq_lens), max_pages).int()
    q = torch.randn(len(seq_lens), heads, C + R, generator=g).to(torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q, cache, block_table, lens = (t.cuda() for t in (q, cache, block_table, lens))
    ref = mla_decode_paged_ref(q, cache, block_table, lens, C, 0.05)
    out = mla_decode_paged(q, cache, block_table, lens, C, 0.05, config=cfg)
    assert _rel_err(out, ref) < 1e-2


@pytest.mark.parametrize(
    "seq_lens,heads,splits",
    [([1], 64, None), ([37, 64, 65], 128, 1), ([5, 1000, 17, 300], 128, None), ([3, 200], 80, 8)],
)
def test_gluon_wide_fp8_matches_reference(
    seq_lens: list[int], heads: int, splits: int | None
) -> None:
    """64 heads a program over an e4m3 pool: QK as e4m3 wgmmas (q's two e4m3 terms chained into
    one accumulator, or one term), V through an fp16 copy the PV group writes."""
    q, kv8, req_to_token, rows, lens, k_scale = _pool(seq_lens, heads, seed=heads + 1)
    args = (q, kv8, req_to_token, rows, lens, C, (C + R) ** -0.5)
    ref = mla_decode_ref(*args, k_scale=k_scale)
    two = WIDE._replace(q_residual=True, gluon_heads=64)
    out = mla_decode(*args, k_scale=k_scale, num_kv_splits=splits, config=two)
    assert out.shape == (len(seq_lens), heads, C) and torch.isfinite(out.float()).all()
    assert _rel_err(out, ref) < 2e-2
    one = mla_decode(
        *args, k_scale=k_scale, num_kv_splits=splits, config=two._replace(q_residual=False)
    )
    assert _rel_err(one, ref) < 8e-2
    # The same two-term error as the 16-head form's (its second term is scaled by 16).
    base = mla_decode(*args, k_scale=k_scale, num_kv_splits=splits, config=_gluon())
    assert _rel_err(out, base) < 2e-2
    for stages in (3,):  # a deeper ring: the same products in the same order
        deep = two._replace(q_residual=False, num_stages=stages)
        assert torch.equal(
            mla_decode(*args, k_scale=k_scale, num_kv_splits=splits, config=deep), one
        )


# The 16-head kernel over a bf16 pool (`gluon_config(..., fp8=False)` below 64 heads): no
# converter, QK and PV as bf16 wgmmas straight from the 2-slot ring.
BF16_16 = gluon_config(16, 1, 1024, fp8=False)


@pytest.mark.parametrize(
    "seq_lens,heads,splits",
    [
        ([1], 16, None),  # one token: one tile, 63 rows masked
        ([37, 64, 65], 16, 1),  # one split (stage 1 writes the output); a tile edge
        ([5, 1000, 17, 300], 16, None),  # mixed lengths, the default split count
        ([3, 200], 20, 8),  # two head groups, the second mostly masked; empty splits
        ([4100], 16, 2),  # many tiles a split: the ring wraps many times
    ],
)
def test_gluon_bf16_matches_reference(seq_lens: list[int], heads: int, splits: int | None) -> None:
    assert BF16_16.gluon and BF16_16.gluon_heads == 16 and BF16_16.num_stages == 2
    _check_bf16(seq_lens, heads, splits, BF16_16, seed=heads + 3)


def test_gluon_bf16_paged() -> None:
    """Pages of 64 with a block table, a request ending mid-page, the default split count."""
    _check_bf16_paged(BF16_16, heads=16, seed=5)
