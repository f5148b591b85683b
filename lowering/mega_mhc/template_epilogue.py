"""Template pieces: after stage A. The tile's accumulator block, the merge (coefficients and
Sinkhorn, whose unrolled lines merge_codegen writes), the fresh collapse and the norm's rescale."""

EPILOGUE = '''\
@triton.jit
def _acc_block(acc_ptr, tile, TILE_T: tl.constexpr, ACC_COPIES: tl.constexpr):
    """Token tile `tile`'s block of the accumulator: ACC_COPIES copies of [SLOT, TILE_T], one
    after the other, each column by column, so that one column of the tile's tokens is one 64-byte
    run and the merge's per-column loads touch a line each, not one per token (its (2+n)n + 1 loads
    of 16 tokens were 416 lines per warp, and every warp of the program issues them; on the H200
    T=1 6.34 -> 5.93 us, T=64 12.39 -> 12.10, T=512 25.49 -> 25.28, T=4096 152.1 -> 146.0).
    Stage-A job `part` of a tile adds into copy part % ACC_COPIES (LaunchConfig.acc_copies): the
    tile's atomics are spread over that many addresses, and the merge sums the copies."""
    return acc_ptr + tile.to(tl.int64) * (ACC_COPIES * SLOT * TILE_T)


@triton.jit
def _in_copy(ptrs, k, TILE_T: tl.constexpr):
    """`ptrs` into copy 0 of a tile's accumulator block, moved to the same places in copy k."""
    return ptrs + k * (SLOT * TILE_T)


@triton.jit
def _tile_column(acc_ptr, tile, col, TILE_T: tl.constexpr, ACC_COPIES: tl.constexpr):
    """Pointers to column `col` of copy 0 of the tile's accumulator block, one per token of the
    tile (other copies: _in_copy)."""
    return _acc_block(acc_ptr, tile, TILE_T, ACC_COPIES) + col * TILE_T + tl.arange(0, TILE_T)


@triton.jit
def _column_sum(column, row_ok, TILE_T: tl.constexpr, ACC_COPIES: tl.constexpr):
    """One column of a tile's partial sums, [TILE_T]: the sum of its copies (`column`: copy 0's
    pointers, _tile_column); plain loads, after the acquire that made the sums complete (_wait)."""
    total = tl.load(column, mask=row_ok, other=0.0)
    for k in tl.static_range(1, ACC_COPIES):
        total += tl.load(_in_copy(column, k, TILE_T), mask=row_ok, other=0.0)
    return total


@triton.jit
def _clear_copies(ptrs, mask, TILE_T: tl.constexpr, ACC_COPIES: tl.constexpr):
    """Zero these partial sums in every copy (for the next launch); `ptrs`: copy 0's, of one tile
    or several, any shape."""
    for k in tl.static_range(ACC_COPIES):
        tl.store(_in_copy(ptrs, k, TILE_T), tl.where(mask, 0.0, 0.0), mask=mask)


@triton.jit
def _tile_csq(acc_ptr, T, tile, TILE_T: tl.constexpr, ACC_COPIES: tl.constexpr):
    """The tile's sum(c^2) per token, from its accumulator block's CSQ_COL."""
    i = tl.arange(0, TILE_T)
    return _column_sum(_tile_column(acc_ptr, tile, CSQ_COL, TILE_T, ACC_COPIES), tile * TILE_T + i < T, TILE_T,
                       ACC_COPIES)


@triton.jit
def _csq_slot(csq_ptr, tile, part, TILE_T: tl.constexpr, CSQ_SLOTS: tl.constexpr):
    """Stage-A job `part`'s slot [TILE_T] of token tile `tile`'s sum(c^2) slots (MONOTONIC):
    csq_ptr is [n_tiles, CSQ_SLOTS, TILE_T], written by the launch's stage-A jobs before they
    arrive, read by its rescale jobs after; every slot read is written first."""
    return csq_ptr + (tile.to(tl.int64) * CSQ_SLOTS + part) * TILE_T


@triton.jit
def _slot_csq(csq_ptr, T, tile, TILE_T: tl.constexpr, CSQ_SLOTS: tl.constexpr, N_SPLITS: tl.constexpr):
    """The tile's sum(c^2) per token from its N_SPLITS stage-A jobs' slots (_csq_slot)."""
    i = tl.arange(0, TILE_T)
    part = tl.arange(0, CSQ_SLOTS)
    ok = (part < N_SPLITS)[:, None] & (tile * TILE_T + i < T)[None, :]
    return tl.reduce(tl.load(_csq_slot(csq_ptr, tile, part[:, None], TILE_T, CSQ_SLOTS) + i[None, :], mask=ok,
                             other=0.0), 0, _add)


@triton.jit
def _inv_rms(csq):
    """rms_normalize's 1/rms of the collapse, from its sum of squares over D."""
    return tl.rsqrt(csq / D + NORM_EPS)


@triton.jit
def _finish_tile(acc_ptr, base_ptr, scale_ptr, pre_ptr, posto_ptr, combo_ptr, ready_ptr, trace_ptr,
                 T, tile, TILE_T: tl.constexpr, ACC_COPIES: tl.constexpr, CLEAR: tl.constexpr,
                 KEEP_CSQ: tl.constexpr, PUBLISH: tl.constexpr, SINKHORN_FACTORS: tl.constexpr,
                 TRACE: tl.constexpr, INTERPRETED: tl.constexpr):
    """From the tile's full-row sums (its accumulator row): compute and store the coefficients,
    one [TILE_T] vector per coefficient (the generator unrolls n, n and n*n of them; Sinkhorn's
    row and column sums are then plain additions). CLEAR: zero the row again for the next launch,
    except sum(c^2) with KEEP_CSQ (epilogue jobs, carried pre: the rescale jobs read it, and the
    launch's last job zeroes it). PUBLISH (epilogue jobs, fresh pre): as soon as pre' is stored,
    set the tile's ready flag, so that the fresh collapse overlaps Sinkhorn (the merge's longest
    part) instead of following it. Returns 1/rms of the carried collapse [TILE_T] (zeros with
    KEEP_CSQ: the rescale jobs compute it, and sum(c^2) is not read here). SINKHORN_FACTORS: the
    rounds update row and column factors of the fixed softmax cells (LaunchConfig.sinkhorn_factors)."""
    rows = tile * TILE_T + tl.arange(0, TILE_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    # column c of the tile's accumulator block at sums + c * TILE_T (copy 0; _column_sum adds the
    # copies)
    sums = _tile_column(acc_ptr, tile, 0, TILE_T, ACC_COPIES)
    if KEEP_CSQ:
        inv_c = tl.full([TILE_T], 0.0, dtype=tl.float32)
    else:
        inv_c = _inv_rms(_tile_csq(acc_ptr, T, tile, TILE_T, ACC_COPIES))  # the carried collapse's
    if HAS_COEFFS:
        s_pre = tl.load(scale_ptr)
        s_post = tl.load(scale_ptr + 1)
        s_comb = tl.load(scale_ptr + 2)
$GATE_LINES
    if CLEAR:  # before any release: a fresh collapse's jobs add their sum(c^2) into this row
        tl.debug_barrier()  # every thread's reads of the row come first
        cols = tl.arange(0, SLOT)[None, :]
        kept = CSQ_COL if KEEP_CSQ else SLOT  # (no column is SLOT)
        # the whole block, padding tokens too (zero already: stage A masks them): a mask that is
        # constant along the tokens leaves the stores vectorised along them, as the merge's loads
        # are. Masked per token they were scalar stores, one 64-byte run per lane, issued by
        # every warp before Sinkhorn: each accumulator copy added ~0.17 us to the T=64 merge.
        _clear_copies(sums[:, None] + cols * TILE_T, tl.broadcast_to(cols != kept, [TILE_T, SLOT]), TILE_T,
                      ACC_COPIES)
    if PUBLISH:
        tl.debug_barrier()
        tl.atomic_xchg(ready_ptr, 1, sem="release")
        _stamp(trace_ptr, EV_READY, TRACE)
    if HAS_COEFFS:
$COMB_LINES
    return inv_c


@triton.jit
def _collapse(x_ptr, xo_ptr, u_ptr, pre_ptr, T, stride_xt, stride_xk, tile, c_begin, c_end,
              TILE_T: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr):
    """Fresh pre: c = hc_pre(X', pre') over chunks [c_begin, c_end), rounded and parked in u (a
    second sweep over X', which this launch wrote). Returns sum(c^2) over those columns."""
    rows = tile * TILE_T + tl.arange(0, TILE_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    # pre' (stored by this tile's merge) as [TILE_T] columns
$FRESH_PRE_LINES
    csq = tl.full([TILE_T], 0.0, dtype=tl.float32)
    for chunk in range(c_begin, c_end):
        d = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
        ok = row_ok[:, None] & (d < D)[None, :]
        if HAS_POST:
            x_ptrs = xo_ptr + rows64[:, None] * ND + d[None, :]
$FRESH_XO_LINES
        else:
            x_ptrs = x_ptr + rows64[:, None] * stride_xt + d[None, :]
$FRESH_X_LINES
$F32_LINES
        collapsed = _round($COLLAPSE_EXPR, INTERPRETED)
        tl.store(u_ptr + rows64[:, None] * D + d[None, :], collapsed, mask=ok)
        cf = _widen(collapsed, INTERPRETED)
        csq += tl.reduce(cf * cf, 1, _add)
    return csq


@triton.jit
def _parked_block(u_ptr, w_ptr, rows64, row_ok, b, b_end, R_BLOCK: tl.constexpr):
    """Column block b of the parked collapse (stream dtype: half the registers of fp32 in flight)
    and of the norm weight; all masked past b_end."""
    d = b * R_BLOCK + tl.arange(0, R_BLOCK)
    d_ok = (d < D) & ((d * 0 + b) < b_end)
    collapsed = tl.load(u_ptr + rows64[:, None] * D + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    return collapsed, tl.load(w_ptr + d, mask=d_ok, other=0.0)


@triton.jit
def _rescale_part(u_ptr, w_ptr, T, tile, inv_c, part, R_PER_JOB: tl.constexpr, TILE_T: tl.constexpr,
                  R_BLOCK: tl.constexpr, RESCALE_STAGES: tl.constexpr, INTERPRETED: tl.constexpr):
    """_rescale over rescale part `part` of the tile: its R_PER_JOB blocks (fewer in D's last part)."""
    b_begin = part * R_PER_JOB
    _rescale(u_ptr, w_ptr, T, tile, inv_c, b_begin, tl.minimum(b_begin + R_PER_JOB, (D + R_BLOCK - 1) // R_BLOCK),
             TILE_T, R_BLOCK, RESCALE_STAGES, INTERPRETED)


@triton.jit
def _rescale(u_ptr, w_ptr, T, tile, inv_c, b_begin, b_end, TILE_T: tl.constexpr,
             R_BLOCK: tl.constexpr, RESCALE_STAGES: tl.constexpr, INTERPRETED: tl.constexpr):
    """u = (c * 1/rms) * norm_weight, in place on the parked collapse, over column blocks
    [b_begin, b_end) of R_BLOCK (wider than the sweep's chunks: this loop only streams).
    RESCALE_STAGES == 0: the next block is loaded before this one is stored (a load placed after a
    store waits for it, so without the prefetch the blocks' round trips follow one another): two
    blocks in flight. RESCALE_STAGES = k >= 2: the loads sit in a `tl.range` loop that Triton
    pipelines through shared memory (cp.async), k - 1 blocks ahead; the blocks never overlap, so
    issuing later blocks' loads before this block's store is safe."""
    rows = tile * TILE_T + tl.arange(0, TILE_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    if RESCALE_STAGES > 0:
        for b in tl.range(b_begin, b_end, num_stages=RESCALE_STAGES):
            collapsed, w = _parked_block(u_ptr, w_ptr, rows64, row_ok, b, b_end, R_BLOCK)
            _store_rescaled(u_ptr, collapsed, w, inv_c, rows64, row_ok, b, R_BLOCK, INTERPRETED)
    else:
        next_c, next_w = _parked_block(u_ptr, w_ptr, rows64, row_ok, b_begin, b_end, R_BLOCK)
        for b in range(b_begin, b_end):
            collapsed, w = next_c, next_w
            next_c, next_w = _parked_block(u_ptr, w_ptr, rows64, row_ok, b + 1, b_end, R_BLOCK)
            _store_rescaled(u_ptr, collapsed, w, inv_c, rows64, row_ok, b, R_BLOCK, INTERPRETED)


@triton.jit
def _store_rescaled(u_ptr, collapsed, w, inv_c, rows64, row_ok, b, R_BLOCK: tl.constexpr,
                    INTERPRETED: tl.constexpr):
    """Column block b of u = (c * 1/rms) * norm_weight, rounded, over the parked collapse."""
    d = b * R_BLOCK + tl.arange(0, R_BLOCK)
    tl.store(u_ptr + rows64[:, None] * D + d[None, :], _rescaled(collapsed, w, inv_c, INTERPRETED),
             mask=row_ok[:, None] & (d < D)[None, :])


@triton.jit
def _rescaled(collapsed, w, inv_c, INTERPRETED: tl.constexpr):
    """u = (c * 1/rms) * norm_weight, rounded (NORM_ROUNDS_TWICE: c * 1/rms rounded first):
    `collapsed` [tokens, columns] (stream dtype), `w` [columns], `inv_c` [tokens]."""
    normalised = _widen(collapsed, INTERPRETED) * inv_c[:, None]
    if NORM_ROUNDS_TWICE:
        normalised = _widen(_round(normalised, INTERPRETED), INTERPRETED)
    return _round(normalised * w[None, :], INTERPRETED)


@triton.jit
def _rescale_at_once(u_ptr, w_ptr, acc_ptr, csq_ptr, T, tile, part, failed, TILE_T: tl.constexpr,
                     PART_COLS: tl.constexpr, ACC_COPIES: tl.constexpr, CSQ_SLOTS: tl.constexpr,
                     N_SPLITS: tl.constexpr, INTERPRETED: tl.constexpr):
    """A rescale job's part (its R_PER_JOB blocks of R_BLOCK columns: PART_COLS, a power of two)
    as one [TILE_T, PART_COLS] block (LaunchConfig.rescale_at_once): the parked collapse and the
    norm weight are loaded before the tile's sum(c^2), so the three loads share one round trip
    (_rescale_part loads its first block only once 1/rms is known: two). NaN where `failed` (a
    corrupted sync state). sum(c^2) from the accumulator, or (CSQ_SLOTS > 0) the tile's slots."""
    rows = tile * TILE_T + tl.arange(0, TILE_T)
    row_ok = rows < T
    d = part * PART_COLS + tl.arange(0, PART_COLS)
    d_ok = d < D
    ok = row_ok[:, None] & d_ok[None, :]
    ptrs = u_ptr + rows.to(tl.int64)[:, None] * D + d[None, :]
    collapsed = tl.load(ptrs, mask=ok, other=0.0)
    w = tl.load(w_ptr + d, mask=d_ok, other=0.0)
    if CSQ_SLOTS > 0:
        csq = _slot_csq(csq_ptr, T, tile, TILE_T, CSQ_SLOTS, N_SPLITS)
    else:
        csq = _tile_csq(acc_ptr, T, tile, TILE_T, ACC_COPIES)
    inv_c = tl.where(failed, float("nan"), _inv_rms(csq))
    tl.store(ptrs, _rescaled(collapsed, w, inv_c, INTERPRETED), mask=ok)


@triton.jit
def _finish_inline(acc_ptr, x_ptr, xo_ptr, u_ptr, w_ptr, base_ptr, scale_ptr, pre_ptr, posto_ptr,
                   combo_ptr, T, stride_xt, stride_xk, tile, TILE_T: tl.constexpr,
                   BLOCK_D: tl.constexpr, N_CHUNKS: tl.constexpr, R_BLOCK: tl.constexpr,
                   RESCALE_STAGES: tl.constexpr, ACC_COPIES: tl.constexpr, CLEAR: tl.constexpr,
                   SINKHORN_FACTORS: tl.constexpr, INTERPRETED: tl.constexpr):
    """Everything after stage A for one whole token tile, by one program."""
    tl.debug_barrier()  # this program's accumulator stores before its reloads
    inv_c = _finish_tile(acc_ptr, base_ptr, scale_ptr, pre_ptr, posto_ptr, combo_ptr, acc_ptr, acc_ptr,
                         T, tile, TILE_T, ACC_COPIES, CLEAR, False, False, SINKHORN_FACTORS, False, INTERPRETED)
    if FRESH:
        tl.debug_barrier()  # pre' (and this tile's X') before the collapse reads them
        csq = _collapse(x_ptr, xo_ptr, u_ptr, pre_ptr, T, stride_xt, stride_xk, tile, 0, N_CHUNKS,
                        TILE_T, BLOCK_D, INTERPRETED)
        inv_c = _inv_rms(csq)
    tl.debug_barrier()  # the parked collapse (stored by every thread) before its reloads
    _rescale(u_ptr, w_ptr, T, tile, inv_c, 0, (D + R_BLOCK - 1) // R_BLOCK, TILE_T, R_BLOCK, RESCALE_STAGES,
             INTERPRETED)


'''
