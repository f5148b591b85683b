"""Mega-mHC kernel (lowering/mega_mhc/) against its torch reference, on CPU via the interpreter.

The kernel source is the one CUDA compiles; here the Triton interpreter runs it, atomics, the job
counter and the epilogue jobs' waits included. Inputs have the model's scales: unit streams and
sublayer output, comb a real Sinkhorn output, fn ~ N(0, 0.1/sqrt(nD)), random base and scale.
D = 160 is no power of two and leaves a partial last chunk. Tolerances are the issue's: X' and u
relative L2 error <= 1e-5 in fp32 and <= 1e-2 in bf16 and fp16, coefficients <= 1e-5.
"""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from megafuse.lowering import kernel_cache
from megafuse.lowering import mega_mhc as mm
from megafuse.lowering.mega_mhc import LaunchConfig, MhcSpec, generate_source, mega_mhc, reference, unsupported_reason
from megafuse.model.mhc import sinkhorn
from tests.marks import slow_beyond

D = 160
OUTPUTS = ("streams", "u", "pre", "post", "comb")  # what mega_mhc and reference return, in order
FORMS = {  # name -> (has_post, has_coefficients, pre)
    "delayed": (True, True, "carried"),
    "first_seam": (False, True, "carried"),
    "engram_seam": (False, True, "carried"),  # the same kernel as the first seam; pre is not one-hot
    "final_collapse": (True, False, "carried"),
    "v4_fresh": (True, True, "fresh"),
    "v4_fresh_no_post": (False, True, "fresh"),
}
# (T, variant or config): the tiled variant, the split one whose last arrival finishes the tile,
# and the split one with epilogue jobs (the rescale, and a fresh collapse, in jobs of their own);
# then the tiled and the epilogue-job split variants with stage A's loop pipelined by Triton; then
# both with the rescale's loop pipelined (rescale_stages), over three column blocks per tile
# (128-token tiles: 64-column blocks) and two per rescale job (64-token tiles: 128-column blocks);
# then stage A in two 16-token sub-tiles (sub_tiles): tiled with the second sub-tile part past T
# (tokens 16..20 of 21), and split with epilogue jobs where the last tile's second sub-tile is
# wholly past T (tokens 32..36 of 37, then 48..63); then the split variants with their partial
# sums in accumulator copies (acc_copies): five slices a tile over three copies (two slices land
# in copies 0 and 1, one in copy 2) with epilogue jobs, and two copies whose last arrival finishes
CASES = ((37, "tiled"), (3, "split"), (1, LaunchConfig(16, 32, 64, r_splits=2)),
         (37, LaunchConfig(16, 32, 64, r_splits=3)),
         (21, LaunchConfig(16, 32, 4096, pipeline_stages=3)),
         (5, LaunchConfig(16, 32, 64, r_splits=2, pipeline_stages=2)),
         (37, LaunchConfig(128, 32, 4096, rescale_stages=3)),
         (37, LaunchConfig(64, 32, 64, r_splits=1, rescale_stages=2)),
         (21, LaunchConfig(32, 32, 4096, pipeline_stages=2, sub_tiles=2)),
         (37, LaunchConfig(32, 32, 64, r_splits=3, pipeline_stages=3, sub_tiles=2, rescale_stages=2)),
         (37, LaunchConfig(16, 32, 32, r_splits=3, acc_copies=3)), (20, LaunchConfig(16, 32, 32, acc_copies=2)))


@pytest.fixture(autouse=True)
def _kernel_cache_in_tmp(tmp_path_factory):
    kernel_cache.set_cache_dir(tmp_path_factory.getbasetemp() / "kernels")
    yield
    kernel_cache.set_cache_dir(None)


def make_spec(form="delayed", dtype="float32", **overrides):
    post, coeffs, pre = FORMS[form]
    spec = MhcSpec(n=4, dim=D, sinkhorn_iters=20, hc_eps=1e-6, stat_eps=1e-20, norm_eps=1e-20,
                   has_post=post, has_coefficients=coeffs, pre=pre, stream_dtype=dtype)
    return dataclasses.replace(spec, **overrides)


def make_inputs(spec, T, seed, one_hot_pre=False):
    g = torch.Generator().manual_seed(seed)
    n, dim = spec.n, spec.dim
    dtype = mm.DTYPES[spec.stream_dtype]
    streams = torch.randn(T, n, dim, generator=g).to(dtype)
    y = torch.randn(T, dim, generator=g).to(dtype)
    post = 2 * torch.sigmoid(torch.randn(T, n, generator=g))
    comb = sinkhorn(torch.randn(T, n, n, generator=g) + 2 * torch.eye(n), 20, 1e-6)
    if one_hot_pre:  # the first seam: every token collapses copy 0 (a broadcast, stride-0 rows)
        carried = torch.nn.functional.one_hot(torch.tensor(0), n).float().expand(T, n)
    else:
        carried = torch.sigmoid(torch.randn(T, n, generator=g)) + 1e-6
    fn = torch.randn((2 + n) * n, n * dim, generator=g) * (0.1 / (n * dim) ** 0.5)
    base = torch.randn((2 + n) * n, generator=g) * 0.5
    base[2 * n:] += (2 * torch.eye(n)).flatten()
    scale = 1 + 0.1 * torch.randn(3, generator=g)
    weight = 1 + 0.1 * torch.randn(dim, generator=g)
    return streams, y, post, comb, carried, fn, base, scale, weight


def poisoned(spec, T):
    n, dim, dtype = spec.n, spec.dim, mm.DTYPES[spec.stream_dtype]
    nan = lambda *shape, dt=torch.float32: torch.full(shape, float("nan"), dtype=dt)
    coeffs = (nan(T, n), nan(T, n), nan(T, n, n)) if spec.has_coefficients else (None, None, None)
    return (nan(T, n, dim, dt=dtype) if spec.has_post else None, nan(T, dim, dt=dtype), *coeffs)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def assert_matches_reference(spec, args, out):
    ref = reference(*args, spec)
    tol = 1e-5 if spec.stream_dtype == "float32" else 1e-2
    for name, got, want in zip(OUTPUTS, out, ref):
        if want is None:
            assert got is None, f"{name} must be None for {spec.form()}"
            continue
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert torch.isfinite(got).all(), f"{name}: unwritten (NaN) or non-finite elements"
        limit = tol if name in ("streams", "u") else 1e-5
        assert rel(got, want) <= limit, f"{name}: rel err {rel(got, want):.2e} > {limit}"


def run_case(spec, T, how, seed, **input_kw):
    args = make_inputs(spec, T, seed, **input_kw)
    kw = {"variant": how} if isinstance(how, str) else {"config": how}
    out = mega_mhc(*args, spec, out=poisoned(spec, T), **kw)
    assert_matches_reference(spec, args, out)
    plan = mm.plan(spec, how if not isinstance(how, str) else mm.choose_config(spec, T, device="cpu", variant=how), T)
    return plan


@pytest.mark.parametrize("dtype", slow_beyond(["bfloat16", "float32", "float16"]))
@pytest.mark.parametrize("form", list(FORMS))
def test_every_form_equals_the_reference_in_every_variant(form, dtype):
    spec = make_spec(form, dtype)
    variants = set()
    for i, (T, how) in enumerate(CASES):
        plan = run_case(spec, T, how, seed=17 * i + T, one_hot_pre=form == "first_seam")
        variants.add((plan["variant"], plan["r_splits"] > 0))
    # the cases really cover: tiled, split with last-arrival finish, split with epilogue jobs
    assert variants == {("tiled", False), ("split", False), ("split", True)}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_norm_rounded_twice_equals_its_reference_and_is_another_function(dtype):
    # norm_rounding="twice": u = ((c * r).to(dtype) * w).to(dtype), Llama-style RMSNorm's order
    spec = make_spec("delayed", dtype, norm_rounding="twice")
    for i, (T, how) in enumerate(CASES[:4]):
        run_case(spec, T, how, seed=5 * i + T)
    args = make_inputs(spec, 37, seed=3)
    twice, once = reference(*args, spec)[1], reference(*args, dataclasses.replace(spec, norm_rounding="once"))[1]
    u = mega_mhc(*args, spec)[1]
    # the order of the roundings shows in ~25% of u's elements; the kernel takes the reference's
    # (an element or two may still differ where c's fp32 sum order moves an fp16 tie)
    assert (twice != once).sum().item() > u.numel() // 5
    assert (u != twice).sum().item() <= 2


def test_outputs_present_per_form():
    assert make_spec("delayed").outputs() == ["streams", "u", "pre", "post", "comb"]
    assert make_spec("first_seam").outputs() == ["u", "pre", "post", "comb"]
    assert make_spec("final_collapse").outputs() == ["streams", "u"]
    assert make_spec("v4_fresh_no_post").outputs() == ["u", "pre", "post", "comb"]


def test_first_seam_one_hot_pre_collapses_copy_zero():
    spec = make_spec("first_seam")
    args = make_inputs(spec, 5, seed=3, one_hot_pre=True)
    _, u, *_ = mega_mhc(*args, spec, variant="split")
    streams, weight = args[0], args[-1]
    x0 = streams[:, 0]
    want = x0 * torch.rsqrt(x0.square().mean(-1, keepdim=True) + 1e-20) * weight
    assert rel(u, want) <= 1e-6


def test_unused_arguments_may_be_none():
    spec = make_spec("first_seam", "bfloat16")
    streams, _, _, _, carried, fn, base, scale, weight = make_inputs(spec, 4, seed=5)
    out = mega_mhc(streams, None, None, None, carried, fn, base, scale, weight, spec)
    assert_matches_reference(spec, (streams, None, None, None, carried, fn, base, scale, weight), out)
    spec = make_spec("final_collapse")
    streams, y, post, comb, carried, _, _, _, weight = make_inputs(spec, 4, seed=6)
    out = mega_mhc(streams, y, post, comb, carried, None, None, None, weight, spec)
    assert_matches_reference(spec, (streams, y, post, comb, carried, None, None, None, weight), out)


def test_strided_streams_and_fp32_sublayer_output():
    spec = make_spec("delayed", "bfloat16")
    streams, y, *rest = make_inputs(spec, 6, seed=8)
    wide = torch.zeros(6, 5, D, dtype=torch.bfloat16)
    wide[:, 1:] = streams
    strided = wide[:, 1:]  # rows 5*D apart: not contiguous
    assert not strided.is_contiguous()
    args = (strided, y.float(), *rest)
    assert_matches_reference(spec, args, mega_mhc(*args, spec))


def test_no_tokens():
    spec = make_spec("delayed")
    x, u, pre, post, comb = mega_mhc(*make_inputs(spec, 0, seed=1), spec)
    assert x.shape == (0, 4, D) and u.shape == (0, D) and pre.shape == (0, 4) and comb.shape == (0, 4, 4)


def test_other_scalars_and_two_streams():
    spec = make_spec("v4_fresh", sinkhorn_iters=3, hc_eps=1e-3, stat_eps=1e-6, norm_eps=1e-5)
    for i, (T, how) in enumerate(CASES[:3]):
        run_case(spec, T, how, seed=40 + i)
    two = make_spec("delayed", "bfloat16", n=2, dim=96)
    for i, (T, how) in enumerate(CASES[:3]):
        run_case(two, T, how, seed=50 + i)


@pytest.mark.parametrize("form", ["delayed", "v4_fresh"])
def test_fp16_streams_round_where_the_reference_rounds(form):
    # X' and c are rounded to fp16 before anything reads them, u when it is stored: the kernel's X'
    # and u are the reference's to the last bit but for fp32 summation-order ties (a handful of
    # elements one fp16 ulp apart), and the coefficients, statistics of the rounded X', within
    # fp32 noise (unrounded, they would move by ~1e-4)
    spec = make_spec(form, "float16")
    args = make_inputs(spec, 37, seed=5)
    ref = reference(*args, spec)
    for how in ("tiled", "split"):
        out = mega_mhc(*args, spec, variant=how)
        for name, got, want in zip(OUTPUTS, out, ref):
            assert got.dtype == want.dtype, name
            if name in ("streams", "u"):
                ulp = torch.finfo(torch.float16).eps * want.float().abs().clamp_min(2 ** -14)
                off = (got.float() - want.float()).abs()
                assert (off <= ulp).all() and (off > 0).float().mean() < 1e-3, name
            else:
                assert rel(got, want) <= 1e-6, name


@pytest.mark.parametrize("form", ["delayed", "v4_fresh"])
def test_claimed_jobs_equal_co_resident_jobs(form):
    # Dispatch.CLAIMED claims every job with an atomic (the path CUDA takes where
    # the grid does not fit on the device at once); the interpreter runs programs in program-id
    # order, the claim order, so both number the jobs alike and give the same bits
    spec = make_spec(form, "bfloat16")
    args = make_inputs(spec, 37, seed=67)
    cfg = LaunchConfig(16, 32, 32, r_splits=3, acc_copies=2)
    claimed = mega_mhc(*args, spec, config=dataclasses.replace(cfg, dispatch=mm.Dispatch.CLAIMED), out=poisoned(spec, 37))
    assert_matches_reference(spec, args, claimed)
    for got, want in zip(mega_mhc(*args, spec, config=cfg), claimed):
        assert torch.equal(got, want)
    assert not mm.states["cpu"].sync.any()


@pytest.mark.parametrize("at_once", [True, pytest.param(False, marks=pytest.mark.slow)])  # the rescale jobs' own parts in one block or the loop
@pytest.mark.parametrize("form", slow_beyond(["delayed", "first_seam", "final_collapse"]))
def test_handoff_jobs_equal_co_resident_jobs_in_every_order(form, at_once):
    # Dispatch.HANDOFF: job = program id without a claim or a cooperative launch, and a rescale
    # job that has waited MAX_SPINS hands its blocks to its tile's last stage-A arrival. In program
    # order (the interpreter's) every tile has arrived before its rescale jobs start: nothing is
    # handed, and the bits equal the co-resident launch's. job_rotation puts the rescale jobs first
    # (all of them, or only the last one): each then finds its tile not arrived, gives its part
    # away, and the tile's last arrival does it after its merge.
    spec = make_spec(form, "bfloat16", dim=600)  # two 512-column rescale blocks a tile: two parts
    T = 37
    args = make_inputs(spec, T, seed=68)
    cfg = LaunchConfig(16, 32, 128, r_splits=2, acc_copies=2, rescale_at_once=at_once)
    plan = mm.plan(spec, dataclasses.replace(cfg, dispatch=mm.Dispatch.HANDOFF), T)
    assert plan["rescale_at_once"] == at_once
    n_a = plan["n_tiles"] * plan["n_splits"]
    assert plan["handoff"] and (plan["n_tiles"], plan["n_splits"], plan["r_splits"]) == (3, 5, 2)
    assert plan["n_jobs"] == n_a + 2 * 3
    co_resident = mega_mhc(*args, spec, config=cfg)
    for rotation in (0, n_a, plan["n_jobs"] - 1):
        got = mega_mhc(*args, spec, config=dataclasses.replace(cfg, dispatch=mm.Dispatch.HANDOFF), out=poisoned(spec, T),
                       job_rotation=rotation)
        assert_matches_reference(spec, args, got)
        assert not mm.states["cpu"].sync.any() and not mm.states["cpu"].acc.any()
        for name, a, b in zip(OUTPUTS, got, co_resident):
            if rotation == 0 or name != "u":
                assert (a is None and b is None) or torch.equal(a, b), (rotation, name)
            else:  # the handed parts were rescaled by another program, in the same arithmetic
                assert torch.equal(a, b), (rotation, name)


def test_handoff_applies_to_the_carried_pre_only_and_job_rotation_needs_it():
    cfg = LaunchConfig(16, 32, 32, r_splits=3, dispatch=mm.Dispatch.HANDOFF)
    fresh, carried = make_spec("v4_fresh"), make_spec("delayed")
    with pytest.raises(ValueError, match="dispatch=handoff needs the carried pre"):
        mm.plan(fresh, cfg, 37)  # its collapse jobs wait on the merge itself
    assert mm.plan(carried, cfg, 37)["handoff"]
    with pytest.raises(ValueError, match="dispatch=handoff needs 1..15 rescale jobs a token tile"):
        mm.plan(carried, dataclasses.replace(cfg, r_splits=0), 37)  # no rescale jobs
    with pytest.raises(ValueError, match="dispatch=handoff needs the carried pre"):
        mega_mhc(*make_inputs(fresh, 37, seed=69), fresh, config=cfg)
    # the table's rows are adapted to the spec instead: no handoff where it cannot run
    assert mm.choose_config(carried, 1).dispatch is mm.Dispatch.HANDOFF
    assert mm.choose_config(fresh, 1).dispatch is mm.Dispatch.RESIDENT
    args = make_inputs(carried, 37, seed=70)
    with pytest.raises(ValueError, match="job_rotation=1 needs a launch with handoff"):
        mega_mhc(*args, carried, config=dataclasses.replace(cfg, dispatch=mm.Dispatch.RESIDENT), job_rotation=1)
    n_jobs = mm.plan(carried, cfg, 37)["n_jobs"]
    with pytest.raises(ValueError, match=f"a value in 0..{n_jobs - 1}"):
        mega_mhc(*args, carried, config=cfg, job_rotation=n_jobs)


@pytest.mark.parametrize("form", slow_beyond(["final_collapse", "delayed", "first_seam"]))  # the carried pre's forms
def test_rescale_at_once_equals_the_block_loop(form):
    # LaunchConfig.rescale_at_once: a rescale job loads its whole part, then sum(c^2), then stores
    # it, in the block loop's arithmetic: the same bits. D=600 in 512-column blocks: one block a
    # job, or two (the second mostly past D); D=160 in one 256-column block. 64-token tiles have
    # 128-column blocks and three a job (no power of two), so the loop stays. The fresh pre keeps
    # its loop (its jobs wait on the merge's 1/rms).
    for dim, T, cfg, r_per_job, at_once in ((600, 37, LaunchConfig(16, 32, 128, r_splits=2, acc_copies=2), 1, True),
                                            (600, 37, LaunchConfig(16, 32, 128, r_splits=1), 2, True),
                                            (160, 37, LaunchConfig(16, 32, 32, r_splits=3), 1, True),
                                            (600, 70, LaunchConfig(64, 32, 128, r_splits=2), 3, False)):
        spec = make_spec(form, "bfloat16", dim=dim)
        args = make_inputs(spec, T, seed=dim + T)
        if not at_once:
            with pytest.raises(ValueError, match="rescale_at_once=True needs a power of two of rescale blocks"):
                mm.plan(spec, dataclasses.replace(cfg, rescale_at_once=True), T)
            continue
        plan = mm.plan(spec, dataclasses.replace(cfg, rescale_at_once=True), T)
        assert (plan["r_per_job"], plan["rescale_at_once"]) == (r_per_job, at_once)
        got = mega_mhc(*args, spec, config=dataclasses.replace(cfg, rescale_at_once=True), out=poisoned(spec, T))
        assert_matches_reference(spec, args, got)
        assert not mm.states["cpu"].sync.any() and not mm.states["cpu"].acc.any()
        for name, a, b in zip(OUTPUTS, got, mega_mhc(*args, spec, config=cfg)):
            assert (a is None and b is None) or torch.equal(a, b), (name, dim, cfg)
    fresh = make_spec("v4_fresh", "bfloat16", dim=600)
    with pytest.raises(ValueError, match="rescale_at_once=True needs the carried pre"):
        mm.plan(fresh, LaunchConfig(16, 32, 128, r_splits=2, rescale_at_once=True), 37)
    # the table's rows are adapted to the spec instead: the block loop where at once cannot run
    assert not mm.choose_config(fresh, 64).rescale_at_once
    assert mm.choose_config(make_spec("delayed"), 64).rescale_at_once


@pytest.mark.parametrize("form", slow_beyond(["delayed", "first_seam", "v4_fresh"]))  # with coefficients: carried, no post, fresh
def test_sinkhorn_on_factors_equals_the_reference_and_the_cell_rounds(form):
    # LaunchConfig.sinkhorn_factors: the rounds update row and column factors of the fixed softmax
    # cells instead of the cells. Same maths, other roundings: within fp32 noise of the cell
    # rounds, and the tolerances against the reference, in both variants and dtypes, and
    # for iteration counts that leave the unrolled loop empty (1), only its remainder (2, 4) or both (6)
    for dtype in ("float32", "bfloat16"):
        for iters in (20, 1, 2, 4, 6):
            spec = make_spec(form, dtype, sinkhorn_iters=iters)
            for T, how in ((37, "split"), (5, "tiled")):
                cfg = mm.choose_config(spec, T, device="cpu", variant=how)
                args = make_inputs(spec, T, seed=71 + iters)
                factors = mega_mhc(*args, spec, config=dataclasses.replace(cfg, sinkhorn_factors=True),
                                   out=poisoned(spec, T))
                assert_matches_reference(spec, args, factors)
                cells = mega_mhc(*args, spec, config=cfg)
                assert rel(factors[4], cells[4]) <= 1e-6, (dtype, iters, how)
                for name, a, b in zip(OUTPUTS, factors, cells):
                    if name not in ("comb",) and a is not None:  # the rest does not see Sinkhorn
                        assert torch.equal(a, b), (name, dtype, iters, how)


def test_a_cuda_launch_is_co_resident_only_when_its_build_fits_the_device(monkeypatch):
    # _fits_at_once compiles the co-resident build (Triton's warmup) and asks its occupancy, unless
    # the grid has more than CO_RESIDENT_CANDIDATE_PER_SM programs an SM: then it does not compile
    props = SimpleNamespace(major=9, minor=0, multi_processor_count=132, warp_size=32,
                            shared_memory_per_multiprocessor=228 * 1024, max_threads_per_multi_processor=2048)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    built = []

    class Kernel:  # stands in for the jitted kernel: warmup returns a build of these resources
        def __init__(self, registers, shared):
            self.build = SimpleNamespace(n_regs=registers, metadata=SimpleNamespace(shared=shared, num_warps=4),
                                         _init_handles=lambda: None)

        def warmup(self, *args, grid, **options):
            built.append(grid)
            return self.build

    cuda = torch.device("cuda")
    two_a_sm, one_a_sm = Kernel(239, 88064), Kernel(128, 200 * 1024)
    assert mm.fits_at_once(two_a_sm, (264,), (), {}, cuda) and not mm.fits_at_once(one_a_sm, (133,), (), {}, cuda)
    assert mm.fits_at_once(one_a_sm, (132,), (), {}, cuda)
    assert built == [(264,), (133,), (132,)]
    assert mm.CO_RESIDENT_CANDIDATE_PER_SM == 2 and not mm.fits_at_once(two_a_sm, (265,), (), {}, cuda)
    assert len(built) == 3  # (265,) was refused without a build


def test_split_launches_leave_the_persistent_state_zero():
    """Fresh and carried epilogue jobs (the carried rescale jobs read sum(c^2) from the accumulator,
    and the launch's last job zeroes it) and the last-arrival mode all restore the zero state."""
    spec = make_spec("v4_fresh")
    run_case(spec, 37, LaunchConfig(16, 32, 64, r_splits=3), seed=60)
    run_case(make_spec("delayed"), 20, "split", seed=61)
    run_case(make_spec("delayed", "bfloat16"), 37, LaunchConfig(16, 32, 64, r_splits=3), seed=62)
    run_case(make_spec("final_collapse"), 37, LaunchConfig(16, 32, 64, r_splits=3), seed=63)
    # every copy of the accumulator too (the merge clears its tile's, the last job sum(c^2)'s, a
    # fresh collapse's last arrival its tile's sum(c^2))
    run_case(make_spec("v4_fresh"), 37, LaunchConfig(16, 32, 32, r_splits=3, acc_copies=3), seed=64)
    run_case(make_spec("delayed", "bfloat16"), 37, LaunchConfig(16, 32, 32, r_splits=2, acc_copies=4), seed=65)
    run_case(make_spec("delayed"), 20, LaunchConfig(16, 32, 32, acc_copies=2), seed=66)
    st = mm.states["cpu"]
    assert not st.sync.any() and not st.acc.any()


def tile_counters(n_splits, r_splits, n_tiles):
    """A copy of the MONOTONIC token-tile counters (arrivals, rescale tickets) of the first tiles."""
    state = mm.states.get("cpu")
    ctr = state.tiles.get((n_splits, r_splits)) if state is not None else None
    return torch.zeros(n_tiles, 2, dtype=torch.int64) if ctr is None else ctr[:2 * n_tiles].view(-1, 2).clone()


@pytest.mark.slow
def test_monotonic_launches_add_one_launch_to_each_tile_and_reset_nothing():
    # Co-resident epilogue jobs with the carried pre run MONOTONIC: a token tile's counters only
    # grow, by N_SPLITS arrivals and R_SPLITS rescale tickets a launch that covers the tile, whatever
    # ran in between (other T, other carried forms and dtypes with the same split), and claimed,
    # hand-off and fresh launches leave them alone (they use the zeroed sync words). Every output
    # equals the reference; the sync words and the accumulator stay zero.
    cfg = LaunchConfig(16, 32, 128, r_splits=2, acc_copies=2)
    carried = make_spec("delayed", "bfloat16", dim=600)  # 5 slices and two 512-column rescale parts a tile
    plan = mm.plan(carried, cfg, 37)
    assert (plan["n_tiles"], plan["n_splits"], plan["r_splits"]) == (3, 5, 2) and not plan["handoff"]
    before = tile_counters(5, 2, 3)
    expected = before.clone()
    for i, (spec, T) in enumerate([(carried, 37), (carried, 5), (make_spec("first_seam", "bfloat16", dim=600), 37),
                                   (make_spec("final_collapse", "float32", dim=600), 20), (carried, 37)]):
        run_case(spec, T, cfg, seed=80 + i)
        expected[:-(-T // 16)] += torch.tensor([5, 2])
        assert torch.equal(tile_counters(5, 2, 3), expected), (spec.form(), T)
    for spec, how in ((carried, dataclasses.replace(cfg, dispatch=mm.Dispatch.CLAIMED)),
                      (carried, dataclasses.replace(cfg, dispatch=mm.Dispatch.HANDOFF)),
                      (make_spec("v4_fresh", "bfloat16", dim=600), cfg)):
        run_case(spec, 37, how, seed=90)
        assert torch.equal(tile_counters(5, 2, 3), expected), (spec.form(), how)
    st = mm.states["cpu"]
    assert not st.sync.any() and not st.acc.any()
    assert torch.equal(expected - before, torch.tensor([[25, 10], [20, 8], [15, 6]]))


def test_monotonic_launch_sums_the_jobs_own_sum_c2_slots_like_the_accumulator():
    # MONOTONIC stage-A jobs store sum(c^2) into slots of their own (no atomics, nothing to clear)
    # and the rescale jobs add the slots: the claimed launch's u (the accumulator's atomics) to
    # fp32 rounding, every other output bit for bit, in the block loop and at once
    for at_once in (False, True):
        spec = make_spec("delayed", "bfloat16", dim=600)
        cfg = LaunchConfig(16, 32, 128, r_splits=2, acc_copies=2, rescale_at_once=at_once)
        args = make_inputs(spec, 37, seed=91)
        slots = mega_mhc(*args, spec, config=cfg, out=poisoned(spec, 37))
        assert_matches_reference(spec, args, slots)
        claimed = mega_mhc(*args, spec, config=dataclasses.replace(cfg, dispatch=mm.Dispatch.CLAIMED))
        for name, a, b in zip(OUTPUTS, slots, claimed):
            if name == "u":  # bf16 u from an fp32 sum in another order: at most a rounding step apart
                assert rel(a, b) <= 1e-3 and (a.float() - b.float()).abs().max() <= 2 ** -6 * b.float().abs().max()
            else:
                assert torch.equal(a, b), (name, at_once)


def test_inconsistent_tile_counters_are_reset_with_a_warning_not_used():
    # a launch aborted between its rescale tickets and its arrivals leaves a tile's counters out of
    # step (the next launch's rescale jobs would wait for arrivals that never come and write NaN,
    # on CUDA); the interpreter checks them before a launch, as it checks the sync words, and resets
    cfg = LaunchConfig(16, 32, 128, r_splits=2)
    spec = make_spec("delayed", "bfloat16", dim=600)
    run_case(spec, 37, cfg, seed=92)
    mm.states["cpu"].tiles[(5, 2)][1] += 1  # tile 0: a rescale ticket without its launch
    with pytest.warns(UserWarning, match="token-tile counters were left inconsistent"):
        run_case(spec, 37, cfg, seed=93)
    assert torch.equal(tile_counters(5, 2, 3), torch.tensor([[5, 2]] * 3))
    mm.reset_sync("cpu")
    assert not tile_counters(5, 2, 3).any()


def test_pdl_is_asked_for_on_cuda_devices_from_sm90_only(monkeypatch):
    # LaunchConfig.pdl: the kernel's PDL constexpr (griddepcontrol.wait, then launch_dependents,
    # before each program's first memory access) and Triton's launch_pdl, on CUDA devices of
    # compute capability 9.0 and up
    cfg, cuda = LaunchConfig(16, 32, 64), torch.device("cuda")
    for capability, pdl in (((9, 0), True), ((10, 0), True), ((8, 9), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert mm.pdl_options(cfg, cuda) == ({"PDL": True, "launch_pdl": True} if pdl else {"PDL": False})
        assert mm.pdl_options(dataclasses.replace(cfg, pdl=False), cuda) == {"PDL": False}
    assert mm.pdl_options(cfg, torch.device("cpu")) == {"PDL": False}  # the interpreter


def test_unsupported_specs_give_reasons():
    ok = make_spec()
    assert unsupported_reason(ok) is None
    cases = {
        "n=3": dataclasses.replace(ok, n=3),
        "fresh without coefficients": dataclasses.replace(ok, has_coefficients=False, pre="fresh"),
        "float64": dataclasses.replace(ok, stream_dtype="float64"),
        "pre mode": dataclasses.replace(ok, pre="delayed"),
        "zero iterations": dataclasses.replace(ok, sinkhorn_iters=0),
        "negative eps": dataclasses.replace(ok, norm_eps=-1.0),
        "nan eps": dataclasses.replace(ok, hc_eps=float("nan")),
        "empty hidden": dataclasses.replace(ok, dim=0),
    }
    for what, spec in cases.items():
        reason = unsupported_reason(spec)
        assert isinstance(reason, str) and len(reason) > 20, what
        with pytest.raises(ValueError, match="unsupported spec"):
            mega_mhc(*make_inputs(ok, 2, seed=0), spec)
        with pytest.raises(ValueError, match="cannot generate"):
            generate_source(spec)


@pytest.mark.parametrize("change, match", [
    (lambda a: {**a, "fn": a["fn"][:, :-1]}, "fn must be"),
    (lambda a: {**a, "y": a["y"].double()}, "y dtype"),
    (lambda a: {**a, "post": None}, "post is required"),
    (lambda a: {**a, "streams": a["streams"].bfloat16()}, "streams dtype"),
    (lambda a: {**a, "comb": a["comb"][:, :, :2]}, "comb must be"),
    (lambda a: {**a, "carried_pre": a["carried_pre"].double()}, "carried_pre dtype"),
    (lambda a: {**a, "norm_weight": a["norm_weight"][:-1]}, "norm_weight must be"),
])
def test_mismatched_arguments_raise_naming_the_argument(change, match):
    spec = make_spec()
    names = ("streams", "y", "post", "comb", "carried_pre", "fn", "base", "scale", "norm_weight")
    args = change(dict(zip(names, make_inputs(spec, 3, seed=2))))
    with pytest.raises(ValueError, match=match):
        mega_mhc(*(args[k] for k in names), spec)


def test_generated_source_is_cached_on_disk(tmp_path):
    kernel_cache.set_cache_dir(tmp_path)
    spec = make_spec("delayed", "bfloat16", hc_eps=2.5e-6)  # a spec no other test loads
    args = make_inputs(spec, 2, seed=9)
    mega_mhc(*args, spec)
    path = tmp_path / f"{mm.kernel_name(spec)}.py"
    assert path.is_file() and path.read_text() == generate_source(spec)
    mtime = path.stat().st_mtime_ns
    mm.source_path(spec)  # same content: left untouched
    assert path.stat().st_mtime_ns == mtime
    text = path.read_text()
    assert "form: delayed seam" in text and "HC_EPS = tl.constexpr(2.5e-06)" in text
    # the key follows every field, and the generated kernel differs with the form
    assert len({make_spec(f).key() for f in ("delayed", "first_seam", "final_collapse", "v4_fresh")}) == 4
    assert make_spec().key() == make_spec().key() != make_spec(norm_eps=1e-6).key()
    assert generate_source(make_spec("final_collapse")) != generate_source(make_spec("delayed"))


def test_describe_names_the_form_and_outputs():
    d = make_spec("v4_fresh", "bfloat16").describe()
    assert d["form"].startswith("V4 non-delayed") and d["unsupported"] is None
    assert d["width"] == 24 and d["slot"] == 32 and d["outputs"] == ["streams", "u", "pre", "post", "comb"]


# fn's bf16 pieces given to the launch (split_fn: what the pass does for frozen weights), stage A
# loading them instead of splitting fn's fp32 blocks: tiled (register double-buffered and
# pipelined), split with last arrival, and split with epilogue jobs and accumulator copies
PIECES_CONFIGS = ((37, LaunchConfig(16, 32, 4096)),
                  (21, LaunchConfig(16, 32, 4096, pipeline_stages=3)),
                  (3, LaunchConfig(16, 32, 64)),
                  (37, LaunchConfig(16, 32, 64, r_splits=3)),
                  (37, LaunchConfig(16, 32, 64, r_splits=2, acc_copies=2)))


@pytest.mark.parametrize("form", slow_beyond(["delayed", "first_seam", "v4_fresh", "v4_fresh_no_post"]))
def test_given_fn_pieces_equal_the_reference_and_the_split_in_the_launch(form):
    spec = make_spec(form, "bfloat16")
    for i, (T, cfg) in enumerate(PIECES_CONFIGS):
        args = make_inputs(spec, T, seed=31 * i + T, one_hot_pre=form == "first_seam")
        given = mega_mhc(*args, spec, config=cfg, fn_pieces=mm.split_fn(args[5], spec), out=poisoned(spec, T))
        assert_matches_reference(spec, args, given)
        # the same pieces as the in-kernel split (_split): the same products, the same bits
        for a, b in zip(given, mega_mhc(*args, spec, config=cfg)):
            assert (a is None and b is None) or torch.equal(a, b), (form, cfg)


def test_split_fn_writes_pieces_that_sum_to_fn():
    spec = make_spec("delayed", "bfloat16")
    fn = make_inputs(spec, 1, seed=3)[5]
    pieces = mm.split_fn(fn, spec)
    hi, lo = pieces[0, :spec.width()].float(), pieces[1, :spec.width()].float()
    assert torch.equal(hi, fn.bfloat16().float())  # rounded to nearest even, as the GPU's cvt.rn
    assert torch.equal(lo, (fn - hi).bfloat16().float())  # the exact residual, rounded
    assert ((hi + lo - fn).abs() <= fn.abs() * 2.0 ** -16).all()  # 16 of fp32's 24 mantissa bits
    assert ((hi - fn).abs() > fn.abs() * 2.0 ** -12).any()  # lo carries real bits: hi alone is bf16
    assert not pieces[:, spec.width():].any()  # the padding rows (which nothing reads) are zeros


def test_fn_pieces_are_checked_like_every_input():
    spec = make_spec("delayed", "bfloat16")
    args = make_inputs(spec, 3, seed=8)
    pieces = mm.split_fn(args[5], spec)
    for bad, match in ((pieces.float(), "fn_pieces dtype float32 must be bfloat16"),
                       (pieces[:, :24], r"fn_pieces must be \[2, 32, 640\]"),
                       (pieces.transpose(1, 2).contiguous().transpose(1, 2), "fn_pieces must be contiguous")):
        with pytest.raises(ValueError, match=match):
            mega_mhc(*args, spec, fn_pieces=bad)
    for other in (make_spec("delayed", "float32"), make_spec("final_collapse", "bfloat16")):
        with pytest.raises(ValueError, match="fn_pieces are for bf16 streams with coefficients"):
            mega_mhc(*make_inputs(other, 3, seed=8), other, fn_pieces=pieces)
        with pytest.raises(ValueError, match="split_fn: fn's bf16 pieces are for bf16 streams with coefficients"):
            mm.split_fn(args[5], other)


def test_trace_is_cuda_only_and_checked():
    spec = make_spec()
    cfg = LaunchConfig(16, 32, 64, r_splits=2)
    assert mm.trace_shape(spec, 37, cfg) == (mm.plan(spec, cfg, 37)["n_jobs"], len(mm.TRACE_EVENTS))
    trace = torch.zeros(mm.trace_shape(spec, 37, cfg), dtype=torch.int64)
    with pytest.raises(ValueError, match="trace needs a CUDA device"):
        mega_mhc(*make_inputs(spec, 37, seed=1), spec, config=cfg, trace=trace)


# leave_out (a timing diagnostic: tools/bench_mhc.py --leave-out) compiles one part of stage A
# out; the outputs are then wrong in exactly the way that part predicts, and only there
@pytest.mark.parametrize("how", ["tiled", LaunchConfig(16, 32, 64, r_splits=2)])
@pytest.mark.parametrize("part", list(mm.LEAVE_OUT_PARTS))
def test_leave_out_removes_exactly_its_part(part, how):
    spec, T = make_spec("delayed"), 21
    args = make_inputs(spec, T, seed=4)
    kw = {"variant": how} if isinstance(how, str) else {"config": how}
    got = dict(zip(OUTPUTS, mega_mhc(*args, spec, out=poisoned(spec, T), leave_out=(part,), **kw)))
    real = dict(zip(OUTPUTS, reference(*args, spec)))
    want = dict(real)
    if part in ("fn_loads", "dots"):  # the coefficients of a zero projection (m = 0)
        no_fn = list(args)
        no_fn[5] = torch.zeros_like(args[5])
        zero_m = dict(zip(OUTPUTS, reference(*no_fn, spec)))
        want.update(pre=zero_m["pre"], post=zero_m["post"], comb=zero_m["comb"])
        assert rel(got["pre"], real["pre"]) > 1e-3  # which the real ones are not
    for name, value in got.items():
        if (part, name) in (("stream_stores", "streams"), ("parked_store", "u")):
            assert torch.isnan(value).all(), f"{name} was written with {part} left out"
        else:
            assert rel(value, want[name]) <= 1e-5, name


def test_leave_out_names_the_valid_parts():
    spec = make_spec()
    with pytest.raises(ValueError, match="'loads'.*valid: fn_loads, dots, stream_stores, parked_store"):
        mega_mhc(*make_inputs(spec, 3, seed=1), spec, leave_out=("loads",))


@pytest.mark.parametrize("bad", [dict(rescale_stages=1), dict(rescale_stages=-2), dict(r_splits=-1),
                                 dict(tile_t=24), dict(split_cols=48), dict(acc_copies=0)])
def test_inconsistent_launch_configs_are_refused(bad):
    # rescale_stages 1 would be a pipelined loop with nothing ahead: slower than 0, never meant
    spec = make_spec()
    cfg = dataclasses.replace(LaunchConfig(16, 32, 64, r_splits=2), **bad)
    with pytest.raises(ValueError, match="inconsistent launch config.*rescale_stages 0 or >= 2, acc_copies >= 1"):
        mega_mhc(*make_inputs(spec, 3, seed=0), spec, config=cfg)


@pytest.mark.parametrize("bad", [dict(sub_tiles=3, tile_t=64), dict(sub_tiles=4, tile_t=64), dict(sub_tiles=0),
                                 dict(sub_tiles=2, tile_t=16), dict(sub_tiles=2, pipeline_stages=0)])
def test_inconsistent_sub_tiles_are_refused(bad):
    # the generated code holds at most two sub-tiles, each at least the dot's 16 rows, and only the
    # pipelined loop sweeps them (the register double-buffered one holds one tile's prefetch)
    spec = make_spec()
    cfg = dataclasses.replace(LaunchConfig(32, 32, 64, r_splits=2, pipeline_stages=2), **bad)
    with pytest.raises(ValueError, match="inconsistent launch config.*sub_tiles must be 1..2, with tile_t / "
                                         "sub_tiles >= 16.*needs pipeline_stages >= 2"):
        mega_mhc(*make_inputs(spec, 3, seed=0), spec, config=cfg)


def test_choose_config_pipelines_the_rescale_only_where_measured_and_free():
    # the T <= 128 and T > 1024 rows pipeline the rescale (measured on the bf16 delayed seam);
    # where stage A stages no fn blocks its pipeline is smaller than the rescale's, so those forms
    # keep 0
    for T in (64, 4096):
        assert mm.choose_config(make_spec("delayed", "bfloat16", dim=5120), T).rescale_stages == 3
        assert mm.choose_config(make_spec("first_seam", "bfloat16", dim=5120), T).rescale_stages == 3
        for spec in (make_spec("delayed", "float32", dim=5120), make_spec("final_collapse", "bfloat16", dim=5120)):
            assert mm.choose_config(spec, T).rescale_stages == 0
    for T in (1, 512, 1024):
        assert mm.choose_config(make_spec("delayed", "bfloat16", dim=5120), T).rescale_stages == 0
    assert mm.choose_config(make_spec("delayed", "bfloat16"), 4096, device="cpu").rescale_stages == 0


def test_choose_config_sub_tiles_only_where_fn_pieces_are_shared():
    # from T=1024 on the bf16 forms with coefficients sweep 32-token tiles as two sub-tiles; the
    # others get the same slices with 16-token tiles (twice the tiles, the same tokens per job)
    for form in ("delayed", "first_seam", "v4_fresh"):
        spec = make_spec(form, "bfloat16", dim=5120)
        assert [(c.tile_t, c.sub_tiles) for c in (mm.choose_config(spec, T) for T in (512, 1024, 4096))] \
            == [(16, 1), (32, 2), (32, 2)]
    for spec in (make_spec("delayed", "float32", dim=5120), make_spec("final_collapse", "bfloat16", dim=5120)):
        sub2 = mm.choose_config(make_spec("delayed", "bfloat16", dim=5120), 4096)
        cfg = mm.choose_config(spec, 4096)
        assert (cfg.tile_t, cfg.sub_tiles) == (16, 1)
        assert (cfg.block_d, cfg.split_cols, cfg.r_splits) == (sub2.block_d, sub2.split_cols, sub2.r_splits)
    # every CUDA row is split; the tiled variant only when forced (and on the CPU)
    spec = make_spec("delayed", "bfloat16", dim=5120)
    assert all(mm.plan(spec, mm.choose_config(spec, T), T)["variant"] == "split" for T in (1, 64, 512, 4096, 10 ** 5))
    assert mm.plan(spec, mm.choose_config(spec, 4096, variant="tiled"), 4096)["variant"] == "tiled"
    assert mm.choose_config(spec, 4096, device="cpu").sub_tiles == 1


def test_reserve_sync_covers_every_smaller_launch(monkeypatch):
    # the table's 16-token band has more tiles at T=512 (32) than the 32-token band at T=544 (17);
    # reserve_sync sizes for the most of any launch up to max_tokens, so none allocates later
    grown, counters = [], {}
    monkeypatch.setattr(mm.state, "split_buffers", lambda device, n_tiles, acc: grown.append((n_tiles, acc)))
    monkeypatch.setattr(mm.state, "tile_counters", lambda device, n_splits, r_splits, n_tiles: counters.__setitem__(
        (n_splits, r_splits), max(counters.get((n_splits, r_splits), 0), n_tiles)))
    spec = make_spec("delayed", "bfloat16", dim=5120)
    mm.reserve_sync(spec, 544, device="cuda")  # (the table only: the allocators are replaced)
    launches = [(mm.plan(spec, cfg, T), cfg)
                for T in range(1, 545) for cfg in [mm.choose_config(spec, T, device="cuda")]]
    assert grown == [(max(p["n_tiles"] for p, _ in launches), max(p["acc_elems"] for p, _ in launches))]
    # every launch that may run MONOTONIC (epilogue jobs, carried pre) has its tile counters, for
    # its most tiles
    needed = {}
    for p, _ in launches:
        if p["r_splits"]:
            key = (p["n_splits"], p["r_splits"])
            needed[key] = max(needed.get(key, 0), p["n_tiles"])
    assert counters == needed and len(needed) == 4  # T <= 16, <= 128, <= 512, <= 1024 (up to 544)
    # 32 16-token tiles at T=512; 17 32-token tiles of 32 columns at T=544 (one copy), more than
    # the T=128 row's 8 tiles x 4 copies of 16 x 32
    assert grown[0] == (32, 17 * 32 * 32)


def test_accumulator_copies_are_at_most_one_per_stage_a_job():
    # D=160 in 64-column slices: 3 stage-A jobs a tile, so at most 3 copies; the tiled variant has
    # one job a tile and plain stores
    spec = make_spec()
    for copies, used in ((1, 1), (2, 2), (3, 3), (8, 3)):
        plan = mm.plan(spec, LaunchConfig(16, 32, 64, r_splits=2, acc_copies=copies), 37)
        assert (plan["n_splits"], plan["acc_copies"]) == (3, used)
        assert plan["acc_elems"] == plan["n_tiles"] * used * 16 * mm.slot_width(4)
    assert mm.plan(spec, LaunchConfig(16, 32, 4096, acc_copies=4), 37)["acc_copies"] == 1
