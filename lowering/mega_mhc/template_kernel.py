"""Template pieces: the sync primitives (arrivals, bounded waits, PDL), trace stamps, job numbering
and the kernel's entry point, mega_mhc_kernel, which runs the tiled and split variants."""

KERNEL = '''\
@triton.jit
def _arrive(counter_ptr):
    """Publish this program's writes (CTA barrier, then one acq_rel atomic at GPU scope, which is
    cumulative over what the barrier ordered) and return the arrival ticket. Acquire too: the last
    arrival goes on to read everyone's partial sums."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel")


@triton.jit
def _wait(counter_ptr, target, MAX_SPINS: tl.constexpr, MASK: tl.constexpr):
    """Spin (acquire) until the counter reaches target; True if it never does (corrupted sync
    state). What the releases published is then read with plain loads (by every thread: Triton's
    scalar atomic is one thread's, followed by a CTA barrier, the cooperative-groups grid-sync
    pattern; on sm_90 the acquire also invalidates the SM's L1, CCTL.IVALL). .cg loads, which
    sm_90 issues as strong GPU-scope loads (LDG.E.STRONG.GPU), are slower on the H200. _arrive's
    acquire serves its merge alike.
    MASK: the count's bits of the counter (a sync word's low bits; -1 for a tile counter)."""
    value = tl.atomic_add(counter_ptr, 0, sem="acquire") & MASK
    spins = 0
    while (value < target) & (spins < MAX_SPINS):
        value = tl.atomic_add(counter_ptr, 0, sem="acquire") & MASK
        spins += 1
    return value < target


@triton.jit
def _await_predecessor():
    """PDL: wait until the stream's previous kernel's writes are visible (griddepcontrol.wait),
    then let the next kernel be scheduled in turn."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _begin(WAIT: tl.constexpr, trace_ptr, TRACE: tl.constexpr):
    """WAIT (a PDL launch whose jobs need no memory to be known): this program's first memory
    access comes next, so wait for the previous kernel's writes (griddepcontrol.wait), let the next
    kernel be scheduled, and stamp the start (and the job, known by now). Everything before it is
    arithmetic on program ids and arguments, which overlaps the previous kernel's end (T=64, sm_90:
    ~45 instructions of the stage-A jobs' set-up moved ahead of the wait)."""
    if WAIT:
        _await_predecessor()
        _stamp(trace_ptr, EV_START, TRACE)
        _stamp(trace_ptr, EV_CLAIMED, TRACE)


@triton.jit
def _stamp(trace_ptr, event, TRACE: tl.constexpr):
    """TRACE: record the GPU's %globaltimer (ns) as `event` of this program's trace row (what
    tools/bench_mhc.py --trace reads: where a launch's time goes). Compiled out otherwise."""
    if TRACE:
        now = tl.inline_asm_elementwise("mov.u64 $$0, %globaltimer;", "=l,r", [tl.program_id(0)],
                                        dtype=tl.int64, is_pure=False, pack=1)
        tl.store(trace_ptr + tl.program_id(0) * TRACE_EVENTS + event, now)


@triton.jit
def _note_job(trace_ptr, job, role, TRACE: tl.constexpr):
    """TRACE: record which job this program ran, its role (ROLE_*) and its SM."""
    if TRACE:
        row = trace_ptr + tl.program_id(0) * TRACE_EVENTS
        tl.store(row + EV_JOB, job.to(tl.int64))
        tl.store(row + EV_ROLE, role)
        sm = tl.inline_asm_elementwise("mov.u32 $$0, %smid;", "=r,r", [tl.program_id(0)], dtype=tl.int32,
                                       is_pure=False, pack=1)
        tl.store(row + EV_SM, sm.to(tl.int64))


@triton.jit
def _epilogue_job(job, n_a, n_c, n_jobs, N_SPLITS: tl.constexpr, R_SPLITS: tl.constexpr):
    """(role, token tile, part) of epilogue-mode job `job`, in claim order: every stage-A job, then
    (fresh pre) every collapse job, then every rescale job; part is the D slice of a stage-A or
    collapse job, the block group of a rescale job. Every job a job waits for has a smaller
    number (see "forward progress"). Past the last job (only with a corrupted sync state) the
    role is -1: no work. n_a, n_c, n_jobs: the stage-A, collapse and all jobs of the launch."""
    role = tl.where(job < n_a, ROLE_STAGE_A, tl.where(job < n_a + n_c, ROLE_COLLAPSE, ROLE_RESCALE))
    role = tl.where(job < n_jobs, role, -1)
    q = tl.where(job < n_a, job, tl.where(job < n_a + n_c, job - n_a, job - n_a - n_c))
    per_tile = tl.where(role == ROLE_RESCALE, R_SPLITS, N_SPLITS)
    return role, q // per_tile, q % per_tile


@triton.jit(do_not_specialize=["T", "n_tiles"])  # one binary for every T
def mega_mhc_kernel(x_ptr, y_ptr, post_ptr, comb_ptr, cpre_ptr, fn_ptr, fns_ptr, base_ptr, scale_ptr, w_ptr,
                    xo_ptr, u_ptr, pre_ptr, posto_ptr, combo_ptr, acc_ptr, ws_ptr, sync_ptr, tiles_ptr, csq_ptr,
                    trace_ptr, T, stride_xt, stride_xk, stride_yt, stride_post, stride_comb, stride_cpre, n_tiles,
                    TILE_T: tl.constexpr, SUB_TILES: tl.constexpr, BLOCK_D: tl.constexpr, N_CHUNKS: tl.constexpr,
                    SPLIT_CHUNKS: tl.constexpr, N_SPLITS: tl.constexpr, R_BLOCK: tl.constexpr,
                    R_PER_JOB: tl.constexpr, R_SPLITS: tl.constexpr, PIPELINE_STAGES: tl.constexpr,
                    RESCALE_STAGES: tl.constexpr, ACC_COPIES: tl.constexpr, PRESPLIT: tl.constexpr,
                    CO_RESIDENT: tl.constexpr, HANDOFF: tl.constexpr, JOB_ROTATE: tl.constexpr,
                    SINKHORN_FACTORS: tl.constexpr, RESCALE_AT_ONCE: tl.constexpr, PART_COLS: tl.constexpr,
                    CSQ_SLOTS: tl.constexpr, INTERPRETED: tl.constexpr, MAX_SPINS: tl.constexpr,
                    TRACE: tl.constexpr, LEAVE_OUT: tl.constexpr, PDL: tl.constexpr):
    """Grid (1-D); D is N_CHUNKS chunks of BLOCK_D, a stage-A job takes SPLIT_CHUNKS of them.

    tiled        (N_SPLITS == 1)                 n_tiles programs, job = program id
    last arrival (N_SPLITS > 1, R_SPLITS == 0)   n_tiles * N_SPLITS programs, job = program id
    epilogue jobs (N_SPLITS > 1, R_SPLITS > 0)   n_tiles * N_SPLITS stage-A jobs, (fresh)
        n_tiles * N_SPLITS collapse jobs, n_tiles * R_SPLITS rescale jobs of R_PER_JOB blocks of
        R_BLOCK columns, claimed in start order, or with CO_RESIDENT (every program resident at once:
        a cooperative launch) or HANDOFF (carried pre: a rescale job that waits MAX_SPINS hands its
        blocks to the tile's last arrival) job = (program id + JOB_ROTATE) % jobs (see "forward
        progress" in docs/mega_mhc.md; JOB_ROTATE, HANDOFF only, tests that order)

    fns_ptr: with PRESPLIT, fn's bf16 pieces, split once on the host (split_fn; else unused).
    acc_ptr: [n_tiles, ACC_COPIES, SLOT, TILE_T] partial sums (_acc_block; split: persistent, all
    zero between launches; stage-A job `part` of a tile adds into copy part % ACC_COPIES);
    ws_ptr: 1/rms per token [n_tiles * TILE_T] (epilogue-job mode).
    trace_ptr: [programs, TRACE_EVENTS] int64 when TRACE (else unused): EV_* timestamps per program.
    LEAVE_OUT: 0, or a timing diagnostic's LEAVE_* bits (stage A parts compiled out; wrong outputs).
    PDL: launched as a programmatic dependent launch (LaunchConfig.pdl): no memory access before
    griddepcontrol.wait, which comes first where jobs are claimed and otherwise just before each
    program's first access (_begin).
    CSQ_SLOTS > 0: MONOTONIC (epilogue jobs, carried pre, every program resident at once, no
    handoff): nothing is reset at the launch's end. Each token tile's two int64 counters in
    tiles_ptr only grow: ARRIVE (stage-A arrivals, N_SPLITS a launch) and RESCALE (rescale jobs'
    tickets, R_SPLITS a launch). A rescale job's ticket gives its launch's number L (ticket //
    R_SPLITS: every earlier launch took exactly R_SPLITS of them), so it waits for ARRIVE to
    reach (L + 1) * N_SPLITS, and a stage-A arrival is the tile's last when its ticket is
    N_SPLITS - 1 mod N_SPLITS. sum(c^2) goes to per-job slots (csq_ptr [n_tiles, CSQ_SLOTS,
    TILE_T], a launch's own buffer), not into the accumulator, which the merge clears as always.
    So no job ends in the launch-wide end count's round trip (~0.5 us after a rescale job's
    stores at T=64); int64 counters cannot wrap (N_SPLITS per launch).
    """
    # PDL: scheduled while the stream's previous kernel may still run, so nothing may touch memory
    # (every input, and the sync state the previous seam launch left zeroed) before the wait for
    # its writes. Where a job is known without memory (LATE: job = program id), each program
    # computes its job and its addresses first and waits just before its first access (_begin),
    # so that set-up overlaps the predecessor's end; a claimed job waits before its claim.
    CLAIMED: tl.constexpr = N_SPLITS > 1 and R_SPLITS > 0 and not HANDOFF and not CO_RESIDENT
    LATE: tl.constexpr = PDL and not CLAIMED
    if not LATE:
        if PDL:
            _await_predecessor()
        _stamp(trace_ptr, EV_START, TRACE)
    if N_SPLITS == 1:
        # tiled: one program per token tile, nothing shared
        tile = tl.program_id(0)
        _sweep_a(x_ptr, y_ptr, post_ptr, comb_ptr, cpre_ptr, fn_ptr, fns_ptr, xo_ptr, u_ptr, acc_ptr, csq_ptr,
                 T, stride_xt, stride_xk, stride_yt, stride_post, stride_comb, stride_cpre,
                 tile, 0, N_CHUNKS, 0, TILE_T, SUB_TILES, BLOCK_D, ACC_COPIES, False, PIPELINE_STAGES,
                 PRESPLIT, LEAVE_OUT, False, LATE, trace_ptr, TRACE, INTERPRETED)
        _note_job(trace_ptr, tile, ROLE_TILED, TRACE)
        _stamp(trace_ptr, EV_WORK, TRACE)
        _finish_inline(acc_ptr, x_ptr, xo_ptr, u_ptr, w_ptr, base_ptr, scale_ptr, pre_ptr, posto_ptr,
                       combo_ptr, T, stride_xt, stride_xk, tile, TILE_T, BLOCK_D, N_CHUNKS, R_BLOCK,
                       RESCALE_STAGES, ACC_COPIES, False, SINKHORN_FACTORS, INTERPRETED)
        _stamp(trace_ptr, EV_FINISHED, TRACE)
    elif R_SPLITS == 0:
        # split, the last arrival finishes the tile: nothing ever waits, so program ids are job ids
        job = tl.program_id(0)
        tile = job // N_SPLITS
        part = job % N_SPLITS
        c_begin = part * SPLIT_CHUNKS
        _sweep_a(x_ptr, y_ptr, post_ptr, comb_ptr, cpre_ptr, fn_ptr, fns_ptr, xo_ptr, u_ptr, acc_ptr, csq_ptr,
                 T, stride_xt, stride_xk, stride_yt, stride_post, stride_comb, stride_cpre,
                 tile, c_begin, tl.minimum(c_begin + SPLIT_CHUNKS, N_CHUNKS), part % ACC_COPIES, TILE_T, SUB_TILES,
                 BLOCK_D, ACC_COPIES, True, PIPELINE_STAGES, PRESPLIT, LEAVE_OUT, False, LATE, trace_ptr, TRACE,
                 INTERPRETED)
        _note_job(trace_ptr, job, ROLE_STAGE_A, TRACE)
        _stamp(trace_ptr, EV_WORK, TRACE)
        arrive_a = sync_ptr + TILE_SYNC + tile * 4 + ARRIVE_A
        ticket = _arrive(arrive_a)
        _stamp(trace_ptr, EV_ARRIVED, TRACE)
        if ticket == N_SPLITS - 1:
            _finish_inline(acc_ptr, x_ptr, xo_ptr, u_ptr, w_ptr, base_ptr, scale_ptr, pre_ptr, posto_ptr,
                           combo_ptr, T, stride_xt, stride_xk, tile, TILE_T, BLOCK_D, N_CHUNKS, R_BLOCK,
                           RESCALE_STAGES, ACC_COPIES, True, SINKHORN_FACTORS, INTERPRETED)
            tl.atomic_xchg(arrive_a, 0, sem="relaxed")  # every arrival of this tile is in
            _stamp(trace_ptr, EV_FINISHED, TRACE)
    else:
        # split with epilogue jobs (see "forward progress"): job = program id (handoff, or every
        # program resident at once), or jobs claimed in start order
        n_a = n_tiles * N_SPLITS
        n_c = n_a if FRESH else 0
        n_jobs = n_a + n_c + n_tiles * R_SPLITS
        if HANDOFF:
            job = (tl.program_id(0) + JOB_ROTATE) % n_jobs
        elif CO_RESIDENT:
            job = tl.program_id(0)
        else:
            job = tl.atomic_add(sync_ptr + JOB_COUNTER, 1, sem="relaxed")
        if not LATE:  # (LATE: _begin stamps it)
            _stamp(trace_ptr, EV_CLAIMED, TRACE)
        inv_ws = ws_ptr
        role, tile, part = _epilogue_job(job, n_a, n_c, n_jobs, N_SPLITS, R_SPLITS)
        MONOTONIC: tl.constexpr = CSQ_SLOTS > 0
        done = tl.full([], 1, tl.int32)  # this program's part of the end-of-launch count (below)
        if role == ROLE_STAGE_A:
            sync = sync_ptr + TILE_SYNC + tile * 4
            c_begin = part * SPLIT_CHUNKS
            _sweep_a(x_ptr, y_ptr, post_ptr, comb_ptr, cpre_ptr, fn_ptr, fns_ptr, xo_ptr, u_ptr, acc_ptr,
                     _csq_slot(csq_ptr, tile, part, TILE_T, CSQ_SLOTS),
                     T, stride_xt, stride_xk, stride_yt, stride_post, stride_comb, stride_cpre,
                     tile, c_begin, tl.minimum(c_begin + SPLIT_CHUNKS, N_CHUNKS), part % ACC_COPIES, TILE_T,
                     SUB_TILES, BLOCK_D, ACC_COPIES, True, PIPELINE_STAGES, PRESPLIT, LEAVE_OUT, MONOTONIC,
                     LATE, trace_ptr, TRACE, INTERPRETED)
            _note_job(trace_ptr, job, ROLE_STAGE_A, TRACE)
            _stamp(trace_ptr, EV_WORK, TRACE)
            if MONOTONIC:
                ticket = _arrive(tiles_ptr + tile * 2 + TILE_ARRIVE) % N_SPLITS
            else:
                ticket = _arrive(sync + ARRIVE_A)
            _stamp(trace_ptr, EV_ARRIVED, TRACE)
            if (ticket & COUNT_MASK) == N_SPLITS - 1:
                # carried pre: nothing waits for this merge (the rescale jobs wait for the tile's
                # arrivals and read sum(c^2) themselves); fresh: the collapse jobs wait for pre'
                _finish_tile(acc_ptr, base_ptr, scale_ptr, pre_ptr, posto_ptr, combo_ptr, sync + READY_A,
                             trace_ptr, T, tile, TILE_T, ACC_COPIES, True, not FRESH, FRESH, SINKHORN_FACTORS,
                             TRACE, INTERPRETED)
                done = tl.full([], 0, tl.int32)
                if HANDOFF:
                    # the rescale parts whose jobs stopped waiting before this arrival (their bits
                    # came with the ticket): this program does them, and counts them as done
                    handed = ticket >> HANDOFF_SHIFT
                    if handed != 0:
                        inv_c = _inv_rms(_tile_csq(acc_ptr, T, tile, TILE_T, ACC_COPIES))
                        for p in range(R_SPLITS):
                            if ((handed >> p) & 1) != 0:
                                _rescale_part(u_ptr, w_ptr, T, tile, inv_c, p, R_PER_JOB, TILE_T, R_BLOCK,
                                              RESCALE_STAGES, INTERPRETED)
                                done += 1
                _stamp(trace_ptr, EV_FINISHED, TRACE)
        elif role == ROLE_COLLAPSE:
            # fresh: collapse this slice with pre' (stored by the tile's merge); sum(c^2) by atomics
            _begin(LATE, trace_ptr, TRACE)
            _note_job(trace_ptr, job, ROLE_COLLAPSE, TRACE)
            sync = sync_ptr + TILE_SYNC + tile * 4
            failed = _wait(sync + READY_A, 1, MAX_SPINS, COUNT_MASK)
            _stamp(trace_ptr, EV_READY, TRACE)
            c_begin = part * SPLIT_CHUNKS
            csq = _collapse(x_ptr, xo_ptr, u_ptr, pre_ptr, T, stride_xt, stride_xk, tile, c_begin,
                            tl.minimum(c_begin + SPLIT_CHUNKS, N_CHUNKS), TILE_T, BLOCK_D, INTERPRETED)
            csq = tl.where(failed, float("nan"), csq)
            rows = tile * TILE_T + tl.arange(0, TILE_T)
            csq_ptrs = _tile_column(acc_ptr, tile, CSQ_COL, TILE_T, ACC_COPIES)
            tl.atomic_add(_in_copy(csq_ptrs, part % ACC_COPIES, TILE_T), csq, mask=rows < T, sem="relaxed")
            _stamp(trace_ptr, EV_WORK, TRACE)
            ticket = _arrive(sync + ARRIVE_C)
            _stamp(trace_ptr, EV_ARRIVED, TRACE)
            if ticket == N_SPLITS - 1:
                tl.store(inv_ws + tile * TILE_T + tl.arange(0, TILE_T),
                         _inv_rms(_tile_csq(acc_ptr, T, tile, TILE_T, ACC_COPIES)))
                tl.debug_barrier()
                _clear_copies(csq_ptrs, rows < T, TILE_T, ACC_COPIES)  # for the next launch
                tl.atomic_xchg(sync + READY_C, 1, sem="release")
                _stamp(trace_ptr, EV_FINISHED, TRACE)
        elif role == ROLE_RESCALE:  # (else no job: only if the sync state was corrupted)
            _begin(LATE, trace_ptr, TRACE)
            _note_job(trace_ptr, job, ROLE_RESCALE, TRACE)
            sync = sync_ptr + TILE_SYNC + tile * 4
            if FRESH:
                failed = _wait(sync + READY_C, 1, MAX_SPINS, COUNT_MASK)
                _stamp(trace_ptr, EV_READY, TRACE)
                inv_c = tl.load(inv_ws + tile * TILE_T + tl.arange(0, TILE_T))
            else:
                # every stage-A job of the tile has arrived (each a release): sum(c^2) is complete,
                # so the rescale need not wait for the tile's merge (coefficients, Sinkhorn)
                if MONOTONIC:
                    tile_ctr = tiles_ptr + tile * 2
                    launch = tl.atomic_add(tile_ctr + TILE_RESCALE, 1, sem="relaxed") // R_SPLITS
                    failed = _wait(tile_ctr + TILE_ARRIVE, (launch + 1) * N_SPLITS, MAX_SPINS, -1)
                else:
                    failed = _wait(sync + ARRIVE_A, N_SPLITS, MAX_SPINS, COUNT_MASK)
                if HANDOFF:
                    if failed:
                        # hand this part to the tile's last arrival, unless that has come meanwhile
                        # (its ticket, the same atomic word, then carried no bit: do it here)
                        bit = tl.full([], 1, tl.int32) << (HANDOFF_SHIFT + part)
                        failed = (tl.atomic_add(sync + ARRIVE_A, bit, sem="acq_rel") & COUNT_MASK) < N_SPLITS
                        done = tl.where(failed, 0, 1)
                _stamp(trace_ptr, EV_READY, TRACE)
                if not RESCALE_AT_ONCE:
                    if MONOTONIC:
                        inv_c = _inv_rms(_slot_csq(csq_ptr, T, tile, TILE_T, CSQ_SLOTS, N_SPLITS))
                    else:
                        inv_c = _inv_rms(_tile_csq(acc_ptr, T, tile, TILE_T, ACC_COPIES))
            if RESCALE_AT_ONCE:  # (carried pre only)
                if done != 0:  # (HANDOFF: 0 where the part was handed off)
                    _rescale_at_once(u_ptr, w_ptr, acc_ptr, csq_ptr, T, tile, part, failed & (not HANDOFF), TILE_T,
                                     PART_COLS, ACC_COPIES, CSQ_SLOTS, N_SPLITS, INTERPRETED)
            else:
                if not HANDOFF:
                    inv_c = tl.where(failed, float("nan"), inv_c)
                if done != 0:  # (HANDOFF: 0 where the part was handed off)
                    _rescale_part(u_ptr, w_ptr, T, tile, inv_c, part, R_PER_JOB, TILE_T, R_BLOCK, RESCALE_STAGES,
                                  INTERPRETED)
            _stamp(trace_ptr, EV_WORK, TRACE)
        else:  # no job: a claim past the last, only with a corrupted sync state; it still counts below
            _begin(LATE, trace_ptr, TRACE)
        # The last job to finish restores the all-zero state: every job number has been claimed
        # and every wait of this launch is over. Relaxed: nothing is published through this
        # counter (every thread's waits are over at the barrier, and the next launch is
        # stream-ordered after this one), so it skips the release fence, ~0.3 us at the launch's end.
        # The tiles' last stage-A arrivals count nothing: once a tile's arrivals are in, its merge
        # reads and writes nothing another job or this reset touches (its accumulator row apart
        # from sum(c^2), which it clears itself; its own outputs), and the reset needs every
        # other job of the tile done (the rescale jobs, after the arrivals; fresh: the collapse
        # jobs, after the merge's publish): so the merge's Sinkhorn does not end in an atomic's
        # round trip. Carried pre: the rescale jobs read sum(c^2), so this reset zeroes it.
        # HANDOFF: a rescale job handed to the last arrival is counted by that program, after it
        # (it reads sum(c^2) too), not by the job's own.
        if done != 0 and not MONOTONIC:  # (MONOTONIC: nothing to restore)
            tl.debug_barrier()
            if tl.atomic_add(sync_ptr + DONE_COUNTER, done, sem="relaxed") + done == n_jobs - n_tiles:
                for i in range(0, n_tiles * 4, 1024):
                    offs = i + tl.arange(0, 1024)
                    tl.store(sync_ptr + TILE_SYNC + offs, tl.full([1024], 0, dtype=tl.int32),
                             mask=offs < n_tiles * 4)
                if not FRESH:
                    for i in range(0, n_tiles * TILE_T, 1024):
                        offs = i + tl.arange(0, 1024)
                        _clear_copies(_acc_block(acc_ptr, offs // TILE_T, TILE_T, ACC_COPIES) + CSQ_COL * TILE_T
                                      + offs % TILE_T, offs < n_tiles * TILE_T, TILE_T, ACC_COPIES)
                tl.atomic_xchg(sync_ptr + JOB_COUNTER, 0, sem="relaxed")
                tl.atomic_xchg(sync_ptr + DONE_COUNTER, 0, sem="relaxed")
    _stamp(trace_ptr, EV_END, TRACE)
'''
