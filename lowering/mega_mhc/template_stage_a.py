"""Template pieces: stage A, the sweep that forms X', parks the carried collapse and adds the
projections and statistics into the tile's accumulator block."""

import string

STAGE_A = '''\
@triton.jit
def _load_streams(x_ptr, y_ptr, rows64, row_ok, stride_xt, stride_xk, stride_yt, chunk, c_end,
                  BLOCK_D: tl.constexpr):
    """One chunk of D of the token rows `rows64` ($STREAM_LOAD_DOC); masked past the job's last
    chunk (chunk >= c_end): nothing is read."""
    d = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    live = (d * 0 + chunk) < c_end  # [BLOCK_D], all equal (a tensor in both Triton modes)
    ok = row_ok[:, None] & ((d < D) & live)[None, :]
    x_ptrs = x_ptr + rows64[:, None] * stride_xt + d[None, :]
$STREAM_LOAD_LINES


@triton.jit
def _load_chunk(x_ptr, y_ptr, fn_ptr, fns_ptr, rows64, row_ok, stride_xt, stride_xk, stride_yt, chunk, c_end,
                BLOCK_D: tl.constexpr, PRESPLIT: tl.constexpr, LEAVE_OUT: tl.constexpr):
    """The raw inputs of one chunk of D ($LOAD_DOC).
    Past the job's last chunk (chunk >= c_end) everything is masked: nothing is read."""
    d = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    live = (d * 0 + chunk) < c_end  # [BLOCK_D], all equal (a tensor in both Triton modes)
$LOAD_LINES


@triton.jit
def _sweep_a(x_ptr, y_ptr, post_ptr, comb_ptr, cpre_ptr, fn_ptr, fns_ptr, xo_ptr, u_ptr, acc_ptr, csq_slot,
             T, stride_xt, stride_xk, stride_yt, stride_post, stride_comb, stride_cpre,
             tile, c_begin, c_end, acc_copy, TILE_T: tl.constexpr, SUB_TILES: tl.constexpr,
             BLOCK_D: tl.constexpr, ACC_COPIES: tl.constexpr, ATOMIC: tl.constexpr,
             PIPELINE_STAGES: tl.constexpr, PRESPLIT: tl.constexpr, LEAVE_OUT: tl.constexpr,
             CSQ_SLOT: tl.constexpr, WAIT: tl.constexpr, trace_ptr, TRACE: tl.constexpr,
             INTERPRETED: tl.constexpr):
    """Stage A for token tile `tile` over chunks [c_begin, c_end) of D: store X' (and the parked,
    unnormalised carried collapse), and add the partial sums into copy `acc_copy` of the tile's
    accumulator block (_acc_block): the (2+n)n projections, sum X'^2 (SUMSQ_COL), sum c^2
    (CSQ_COL; with CSQ_SLOT, this job's own slot `csq_slot` of the tile's sum(c^2) slots instead,
    see MONOTONIC); with atomics when D is split (ATOMIC), else with plain stores.

    Every stream is its own [SUB_T, BLOCK_D] tile (the generator unrolls the n streams), so all
    the arithmetic is elementwise in one register layout. SUB_TILES = 2 (pipelined loop only)
    sweeps the tile as two sub-tiles of SUB_T = TILE_T / 2 tokens, one after the other within each
    chunk: fn's block is loaded (and split) once for both, so fn is read once per TILE_T tokens
    while the register tiles stay SUB_T tall. The next chunk's inputs are loaded before this
    chunk is computed (register double-buffering: the loads' latency overlaps the arithmetic and
    the stores). Loops run over chunk numbers: every chunk starts at a known multiple of BLOCK_D
    (aligned, vectorised accesses), and the only partial chunk is D's last (masks against
    constexpr D). WAIT (PDL, job = program id): the first memory access of the program is here,
    after the set-up that needs none (_begin)."""
    SUB_T: tl.constexpr = TILE_T // SUB_TILES
$SUB_ROWS
    _begin(WAIT, trace_ptr, TRACE)
$SUB_SETUP
    if PIPELINE_STAGES > 0:
        # loads inside the loop; Triton's pipeliner keeps PIPELINE_STAGES - 1 chunks in flight
        # through shared memory (cp.async), not in registers
        for chunk in tl.range(c_begin, c_end, num_stages=PIPELINE_STAGES):
            $CUR_NAMES = _load_chunk(
                x_ptr, y_ptr, fn_ptr, fns_ptr, rows64, row_ok, stride_xt, stride_xk, stride_yt, chunk, c_end,
                BLOCK_D, PRESPLIT, LEAVE_OUT)
            if SUB_TILES > 1:
                $CUR_NAMES_S1 = _load_streams(
                    x_ptr, y_ptr, rows64_s1, row_ok_s1, stride_xt, stride_xk, stride_yt, chunk, c_end, BLOCK_D)
$PIPELINED_BODY
    else:
        tl.static_assert(SUB_TILES == 1, "sub-tiles need the pipelined loop (PIPELINE_STAGES >= 2)")
        # register double-buffering: the next chunk's loads are issued before this one is computed
        $NEXT_NAMES = _load_chunk(
            x_ptr, y_ptr, fn_ptr, fns_ptr, rows64, row_ok, stride_xt, stride_xk, stride_yt, c_begin, c_end,
            BLOCK_D, PRESPLIT, LEAVE_OUT)
        for chunk in range(c_begin, c_end):
            $CUR_NAMES = $NEXT_NAMES
            $NEXT_NAMES = _load_chunk(
                x_ptr, y_ptr, fn_ptr, fns_ptr, rows64, row_ok, stride_xt, stride_xk, stride_yt, chunk + 1, c_end,
                BLOCK_D, PRESPLIT, LEAVE_OUT)
$BUFFERED_BODY
$SUB_FINISH


@triton.jit
def _add_partials(acc_ptr, csq_slot, T, tile, acc_copy, rows64, row_ok, acc, sumsq, csq, TILE_T: tl.constexpr,
                  ACC_COPIES: tl.constexpr, ATOMIC: tl.constexpr, CSQ_SLOT: tl.constexpr):
    """Add one sub-tile's partial sums into its tokens of copy `acc_copy` of the tile's accumulator
    block (_acc_block): [SUB_T, SLOT] of the projections, with sum X'^2 and sum c^2 in their columns.
    CSQ_SLOT: sum c^2 is stored into this job's slot `csq_slot` [TILE_T] instead (MONOTONIC)."""
    cols = tl.arange(0, SLOT)[None, :]
    part = tl.where(cols == SUMSQ_COL, sumsq[:, None], tl.where(cols == CSQ_COL, csq[:, None], acc))
    offs = cols * TILE_T + (rows64 - tile * TILE_T)[:, None]  # (token within the tile, column)
    acc_ptr = _in_copy(_acc_block(acc_ptr, tile, TILE_T, ACC_COPIES), acc_copy, TILE_T)
    if CSQ_SLOT:
        # plain stores, published by the arrival (a release) like the atomics
        tl.store(csq_slot + (rows64 - tile * TILE_T), csq, mask=row_ok)
    if ATOMIC:
        # relaxed: the tile's arrival (a release) publishes them. Masked by quads of tokens
        # (ATOMIC_QUAD), not tokens: a mask constant over each thread's four consecutive tokens
        # of a column lets them go as one vector atomic (sm_90 red.global.add.v4.f32: a quarter
        # of the atomics the L2 serves; with every token unmasked, the same atomics where T fills
        # its tiles, T=64 7.90 against 8.45 us and T=512 23.5 against 24.0 on one H200). The
        # padding tokens a quad adds are
        # zeros (stage A's loads mask them) and the merge clears the whole block; masking whole
        # quads past T keeps T=1's atomics as few as before (all 16 tokens: 5.17 against 4.73)
        quad_ok = (rows64 // ATOMIC_QUAD) * ATOMIC_QUAD < T
        added = CSQ_COL - 1 if CSQ_SLOT else CSQ_COL  # (CSQ_COL is the last column of partial sums)
        tl.atomic_add(acc_ptr + offs, part, mask=quad_ok[:, None] & (cols <= added), sem="relaxed")
    else:
        tl.store(acc_ptr + offs, part, mask=row_ok[:, None])


'''

# The body of stage A's loop over chunks (indented for a loop body at 8 spaces); the template
# places it in both loop forms (register double-buffering and Triton-pipelined).
CHUNK_BODY = string.Template('''\
d = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
$SUB_BODY
if SUB_TILES > 1:
$SUB_BODY_S1
if HAS_COEFFS:
    if (LEAVE_DOTS & LEAVE_OUT) == 0:
$PROJECT_LINES
''')

# One sub-tile's share of a chunk (names suffixed per sub-tile by the generator; fn's block and d
# are shared).
SUB_BODY = string.Template('''\
ok$S = row_ok$S[:, None] & (d < D)[None, :]  # [SUB_T, BLOCK_D]
if HAS_POST:
$POST_LINES
# every later step reads the rounded X', like the reference
$F32_LINES
if HAS_COEFFS:
    sumsq$S += tl.reduce($SUMSQ_EXPR, 1, _add)
if not FRESH:
    # hc_pre with the carried pre, rounded like the reference; parked in u until the
    # norm's statistic (the whole row) is known
    collapsed = _round($COLLAPSE_EXPR, INTERPRETED)
    # evict_last: the rescale reads it back at the tile's end; the streams (loads and X')
    # are evict_first, so at large T the parked collapse is what stays in L2
    if (LEAVE_PARKED_STORE & LEAVE_OUT) == 0:
        tl.store(u_ptr + rows64$S[:, None] * D + d[None, :], collapsed, mask=ok$S, eviction_policy="evict_last")
    cf = _widen(collapsed, INTERPRETED)
    csq$S += tl.reduce(cf * cf, 1, _add)
''')
