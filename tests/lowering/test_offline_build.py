"""Every generated kernel builds for Hopper (sm_90) on a machine without a GPU.

The CPU tests run the kernels in Triton's interpreter, which never meets the compiler; these build
the same sources with the launch configurations the H200 uses, to PTX and a cubin (Triton's
ahead-of-time path, its bundled ptxas; `lowering/offline.py`), and check what a launch needs:
shared memory within an SM's limit and no register spills in the hot loop (the kernels keep their
tiles in registers by design; the H200's builds of the stop-11 kernels reported none:
results/tools/inspect_proxy.json).
"""

import collections
import dataclasses
import json
import re
from types import SimpleNamespace

import pytest
import torch
import triton

from megafuse.lowering import mega_attention, mega_mhc, occupancy, offline
from tests.marks import slow_beyond
from megafuse.tools import hopper_builds

pytestmark = pytest.mark.offline_build

# Tests that pin exact instruction or atomic counts of a build were measured with this Triton (the
# CPU suite's); another version compiles differently and they skip there, saying so.
COUNTS_MEASURED_ON = "3.9.0"
pins_counts = pytest.mark.skipif(triton.__version__ != COUNTS_MEASURED_ON,
                                 reason=f"exact PTX/SASS counts measured with Triton {COUNTS_MEASURED_ON}, "
                                        f"not {triton.__version__}")


def _check(build: offline.Build, stack_limit: int = 64):
    assert build.target == "cuda sm_90"
    assert build.cubin and ".target sm_90" in build.ptx
    assert 0 <= build.shared_bytes <= offline.HOPPER_SMEM_PER_BLOCK
    # The tiles live in registers by design. Where ptxas fills the register file (two sub-tiles at
    # 255 registers; the fresh form's T=64 and 512 builds at 168, three programs per SM) a few
    # values spill (8-48 B): never stored inside the hottest loop (a stage-A chunk), and reloaded
    # there (from L1) at most 4 times in ~800-1300 instructions
    assert build.stack_bytes <= stack_limit, f"{build.name}: {build.stack_bytes} B of stack / local memory per thread (spills)"
    if build.stack_bytes and stack_limit <= 64:
        hot = build.loops()[0]
        assert hot.opcodes["STL"] == 0 and hot.opcodes["LDL"] <= 4, (build.name, hot.opcodes["STL"], hot.opcodes["LDL"])
    assert build.registers is not None and build.registers <= 255
    assert build.constexprs.get("INTERPRETED", False) is False  # the compiler's branches were built


@pytest.mark.parametrize("T", slow_beyond(hopper_builds.TOKENS))  # both mhc variants, every gate band
@pytest.mark.parametrize("form", slow_beyond(hopper_builds.MHC_FORMS))
def test_mega_mhc_builds_for_hopper(form, T):
    build = hopper_builds.build_mhc(form, T)
    _check(build)
    spec = hopper_builds.mhc_spec(form)
    config = mega_mhc.choose_config(spec, T, device="cuda")
    assert build.grid == (mega_mhc.plan(spec, config, T)["n_jobs"],)
    assert build.constexprs["TILE_T"] == config.tile_t and build.num_warps == config.num_warps


@pytest.mark.parametrize("T", slow_beyond(hopper_builds.TOKENS))
@pytest.mark.parametrize("input_dtype", slow_beyond(hopper_builds.GATE_INPUTS))
def test_mega_gate_builds_for_hopper(input_dtype, T):
    build = hopper_builds.build_gate(input_dtype, T)
    _check(build)
    assert build.constexprs["BLOCK_T"] == hopper_builds.mega_gate.choose_config(
        hopper_builds.gate_spec(input_dtype), T, device="cuda").block_t


@pytest.mark.parametrize("T", slow_beyond([1, 4096]))
def test_mega_attention_builds_for_hopper(T):
    """V4 widths (64 heads x 512, 640 keys): decode rows split the keys (kernel + combine), a
    prefill chunk does not; every build within Hopper's limits, the tiles in registers."""
    builds = hopper_builds.build_attention(T)
    config = mega_attention.choose_config(hopper_builds.ATTENTION_SPEC, T, hopper_builds.ATTENDED)
    assert [b.name for b in builds] == [mega_attention.KERNEL_NAME] + [mega_attention.COMBINE_NAME] * (config.splits > 1)
    assert builds[0].grid == (T * hopper_builds.HEADS // config.block_h, config.splits)  # rows x head blocks, splits
    wide = config.block_h * hopper_builds.ATTENTION_SPEC.head_dim > mega_attention.ACC_ELEMENTS
    for build in builds:
        # the wide tile (32 heads x 512 of fp32 accumulator, 128 registers a thread) spills a few
        # hundred bytes and still runs faster from 64 rows (docs/mega_attention.md, the launch table)
        _check(build, stack_limit=512 if wide and build.name == mega_attention.KERNEL_NAME else 0)
        assert wide or build.stack_bytes == 0


def test_the_build_is_specialised_like_a_launch():
    # ints equal to 1 become constexprs, 16-divisible pointers and ints carry that divisibility (as
    # Triton's launcher does: without it no 16-byte vector access is allowed), do_not_specialize
    # arguments stay plain; the interpreter's branches are never the ones built
    spec = hopper_builds.mhc_spec("delayed")
    with offline._recording(mega_mhc) as recorders:
        mega_mhc.mega_mhc(*hopper_builds.mhc_inputs(spec, 1), spec, config=mega_mhc.choose_config(spec, 1, device="cuda"))
    ((grid, args, kwargs),) = recorders[0].calls
    kernel = recorders[0].kernel
    backend = offline.make_backend(offline.HOPPER)
    signature, constexprs, attrs, options = offline._signature(kernel, args, kwargs, backend)
    names = kernel.arg_names
    assert signature["x_ptr"] == "*bf16" and signature["fn_ptr"] == "*fp32" and signature["sync_ptr"] == "*i32"
    assert (names.index("x_ptr"),) in attrs  # a fresh torch tensor is 64-byte aligned
    assert signature["T"] == "i32" and (names.index("T"),) not in attrs  # T == 1, but do_not_specialize
    assert constexprs["INTERPRETED"] is False and signature["INTERPRETED"] == "constexpr"
    assert options == {"num_warps": kwargs["num_warps"], "num_stages": kwargs["num_stages"], "enable_fp_fusion": True}
    assert signature["stride_xk"] == "i32" and (names.index("stride_xk"),) in attrs  # D = 5120 = 16 * 320
    assert (names.index("stride_post"),) not in attrs  # n = 4
    strided = list(args)
    strided[names.index("stride_post")] = 1  # a stride of 1 is compiled in
    signature, constexprs, _, _ = offline._signature(kernel, tuple(strided), kwargs, backend)
    assert signature["stride_post"] == "constexpr" and constexprs["stride_post"] == 1


@pytest.mark.parametrize("T", slow_beyond([64, 4096]))
def test_a_pipelined_stage_a_builds_with_async_copies_and_fewer_registers(T):
    # LaunchConfig.pipeline_stages: the chunk loads move into a tl.range loop that Triton pipelines
    # through shared memory. It must really be pipelined (cp.async in the PTX), and it is worth a
    # sweep only because it frees registers (the tuned double-buffered build has none to spare).
    tuned = mega_mhc.choose_config(hopper_builds.mhc_spec("delayed"), T, device="cuda")
    # stage A's pipeline alone, on 16-token tiles (sub-tiles need the pipelined loop)
    tuned = dataclasses.replace(tuned, rescale_stages=0, tile_t=16, sub_tiles=1)
    buffered = hopper_builds.build_mhc("delayed", T, config=dataclasses.replace(tuned, pipeline_stages=0))
    pipelined = hopper_builds.build_mhc("delayed", T, config=dataclasses.replace(tuned, pipeline_stages=3))
    _check(pipelined)
    assert "cp.async" not in buffered.ptx and pipelined.ptx.count("cp.async") > 0
    assert pipelined.registers < buffered.registers
    assert pipelined.shared_bytes > buffered.shared_bytes  # two chunks in flight, in shared memory


def test_two_sub_tiles_load_and_split_each_block_of_fn_once():
    # LaunchConfig.sub_tiles (the T=4096 row): the chunk projects two 16-token sub-tiles (twice the
    # tensor-core dots of a 16-token tile's chunk) onto one load and one split of fn's block. On
    # sm_90: 26 cp.async (16 for fn's block, 5 per sub-tile's y and X) against 21; 104 bf16
    # conversions (64 of them fn's split) against 84; 1286 instructions against 2 x 784
    spec = hopper_builds.mhc_spec("delayed")
    tuned = mega_mhc.choose_config(spec, 4096, device="cuda")
    assert (tuned.tile_t, tuned.sub_tiles) == (32, 2)
    sub2 = hopper_builds.build_mhc("delayed", 4096, config=tuned)
    one = hopper_builds.build_mhc("delayed", 4096, config=dataclasses.replace(tuned, tile_t=16, sub_tiles=1))
    _check(sub2)
    _check(one)
    chunk2, chunk1 = sub2.loops()[0], one.loops()[0]
    assert chunk2.opcodes["HMMA"] == 2 * chunk1.opcodes["HMMA"] > 0
    assert chunk2.opcodes["LDGSTS"] < 1.5 * chunk1.opcodes["LDGSTS"]  # fn's block once (twice: 2x)
    assert chunk2.opcodes["F2FP"] < 1.5 * chunk1.opcodes["F2FP"]  # split once (twice: 2x)
    assert chunk2.instructions < 1.7 * chunk1.instructions
    assert sub2.programs_per_sm() == one.programs_per_sm() == 2


def test_given_fn_pieces_drop_the_split_from_stage_a():
    # fn_pieces (split_fn once, as the pass does for frozen weights): the seam kernel no longer
    # converts fn to bf16 (cvt.rn.bf16x2.f32 in PTX) in every chunk of every token tile
    spec = hopper_builds.mhc_spec("delayed")
    tuned = mega_mhc.choose_config(spec, 4096, device="cuda")
    tuned = dataclasses.replace(tuned, tile_t=16, sub_tiles=1)  # one tile's chunk: the split's full share
    inputs = hopper_builds.mhc_inputs(spec, 4096)
    given = offline.build_kernel(mega_mhc, mega_mhc.mega_mhc, *inputs, spec, config=tuned,
                                 fn_pieces=mega_mhc.split_fn(inputs[5], spec))
    inline = hopper_builds.build_mhc("delayed", 4096, config=tuned)
    assert given.constexprs["PRESPLIT"] and not inline.constexprs["PRESPLIT"]
    _check(given)
    converts = lambda b: len(re.findall(r"cvt\.rn\.bf16(x2)?\.f32", b.ptx))
    assert converts(given) < converts(inline) // 2
    # one stage-A chunk (the largest loop: the one with the tensor-core dots) costs over 20% fewer
    # instructions (sm_90: ~570 instead of ~790)
    chunk, inline_chunk = given.loops()[0], inline.loops()[0]
    assert chunk.opcodes["HMMA"] > 0 and inline_chunk.opcodes["HMMA"] > 0
    assert chunk.instructions < 0.8 * inline_chunk.instructions


def test_the_tuned_large_T_rescale_is_pipelined_in_the_sweeps_shared_memory():
    # rescale_stages (the T=4096 row): the rescale's loads go through shared memory (cp.async),
    # two blocks ahead, in the space stage A's pipeline used: no more shared memory per program
    tuned = mega_mhc.choose_config(hopper_builds.mhc_spec("delayed"), 4096, device="cuda")
    assert tuned.rescale_stages == 3
    pipelined = hopper_builds.build_mhc("delayed", 4096, config=tuned)
    buffered = hopper_builds.build_mhc("delayed", 4096, config=dataclasses.replace(tuned, rescale_stages=0))
    _check(pipelined)
    rescale = lambda b: next(loop for loop in b.loops() if loop.opcodes["STG"] and not loop.opcodes["HMMA"]
                             and not loop.opcodes["MUFU"])
    assert rescale(pipelined).opcodes["LDGSTS"] > 0 and rescale(buffered).opcodes["LDGSTS"] == 0
    assert pipelined.shared_bytes == buffered.shared_bytes
    assert pipelined.programs_per_sm() == buffered.programs_per_sm() == 2


@pins_counts
@pytest.mark.parametrize("form", slow_beyond(["delayed", "fresh"]))
def test_stage_a_converts_bf16_in_pairs(form):
    # _round: two fp32 values per cvt.rn.bf16x2.f32, never one at a time (cvt.rn.bf16.f32); _widen:
    # a bf16 pair widened by one shl and one and (no prmt moving the high half down first). On the
    # T=512 row's sm_90 build that is ~790 instructions per stage-A chunk instead of ~905, and 188
    # registers instead of 244
    build = hopper_builds.build_mhc(form, 512, config=mega_mhc.LaunchConfig(16, 64, 640, 8, pipeline_stages=3))
    _check(build)
    assert not build.constexprs["CO_RESIDENT"]  # 416 programs do not fit an H200 at once: claimed jobs
    assert len(re.findall(r"cvt\.rn\.bf16x2\.f32", build.ptx)) > 0
    assert re.search(r"cvt\.rn\.bf16\.f32", build.ptx) is None
    assert re.search(r"and\.b32 %r\d+, %r\d+, 0xFFFF0000;", build.ptx)  # _widen's high half
    chunk = build.loops()[0]
    assert chunk.opcodes["HMMA"] > 0 and chunk.instructions < 850
    if form == "delayed":
        assert build.registers < 200


def test_sass_loops_are_the_bodies_of_backward_branches_largest_first():
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   FFMA R3, R2, R2, R3 ;
        /*0030*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;
        /*0040*/               @P0 BRA 0x20 ;
        /*0050*/               @!P1 BRA 0x70 ;
        /*0060*/                   FADD R3, R3, 1 ;
        /*0070*/                   FMUL R3, R3, R3 ;
        /*0080*/               @P2 BRA 0x10 ;
        /*0090*/                   EXIT ;
    """
    outer, inner = offline.sass_loops(sass)
    assert (outer.start, outer.end, outer.instructions) == (0x10, 0x80, 8)  # the forward BRA is no loop
    assert (inner.start, inner.end, inner.instructions) == (0x20, 0x40, 3)
    assert inner.opcodes == {"FFMA": 1, "HMMA": 1, "BRA": 1} and outer.opcodes["BRA"] == 3


def test_programs_per_sm_is_the_tightest_hopper_limit():
    def build(registers, warps, smem):
        return offline.Build("k", "cuda sm_90", (1,), {}, warps, 2, smem, registers, 0, "", b"")

    # 244 registers -> 7936 per warp (31 units of 256); 4 warps -> 31744: two programs' worth of 65536
    assert build(244, 4, 10240).programs_per_sm() == 2
    assert build(162, 4, 5120).programs_per_sm() == 3  # 5376 per warp -> 21504 per program
    assert build(32, 4, 200 * 1024).programs_per_sm() == 1  # shared memory binds: 228 KB / 201 KB
    assert build(32, 4, 0).programs_per_sm() == 16  # warps bind: 64 / 4
    assert build(16, 1, 0).programs_per_sm() == 32  # the block limit
    assert build(None, 4, 0).programs_per_sm() is None


def test_the_t64_merge_is_co_resident_with_approximate_exp_and_sinkhorn_in_fours():
    # the tuned T=64 grid (128 programs) fits an H200 at once: job = program id, no claim. The
    # merge's exp is one ex2.approx.ftz (no subnormal range test), and Sinkhorn's rounds run
    # SINKHORN_UNROLL to a loop trip: one loop whose body holds that many rounds' reciprocals
    # (n row and n column reciprocals a round)
    build = hopper_builds.build_mhc("delayed", 64)
    assert build.constexprs["CO_RESIDENT"] and build.grid == (128,)
    assert "ex2.approx.ftz.f32" in build.ptx and "ex2.approx.f32" not in build.ptx
    sinkhorn = [loop for loop in build.loops() if loop.opcodes.get("MUFU")]
    assert [loop.opcodes["MUFU"] for loop in sinkhorn] == [2 * 4 * mega_mhc.SINKHORN_UNROLL]


@pins_counts
def test_a_handoff_launch_builds_for_sm90_without_claim_or_cooperative_grid():
    # Dispatch.HANDOFF on the tuned T=64 row: job = program id and no co-resident build (the
    # launcher neither claims nor launches cooperatively); the tile's last arrival holds the handed
    # parts' rescale loop after its merge, the rescale jobs a bounded wait and the hand-off atomic
    cfg = dataclasses.replace(mega_mhc.choose_config(hopper_builds.mhc_spec("delayed"), 64, device="cuda"),
                              dispatch=mega_mhc.Dispatch.HANDOFF)
    build = hopper_builds.build_mhc("delayed", 64, config=cfg)
    assert build.constexprs["HANDOFF"] and not build.constexprs["CO_RESIDENT"] and build.grid == (128,)
    assert build.programs_per_sm() >= 1 and build.stack_bytes == 0
    tuned = hopper_builds.build_mhc("delayed", 64)
    assert tuned.constexprs["CO_RESIDENT"] and not tuned.constexprs["HANDOFF"]
    # the hand-off launch counts in the u32 sync words: two acq_rel adds (every stage-A job's
    # arrival and a rescale job's hand-off) and one relaxed add (the end-of-launch count; no claim);
    # the tuned launch runs MONOTONIC on u64 tile counters: the arrival and a rescale job's ticket,
    # no end count. Four more loops: the last arrival's loop over handed parts, holding another copy
    # of the rescale's block loop, and the two of the end-of-launch reset (sync words, sum(c^2))
    atomics = lambda b, bits: (b.ptx.count(f"atom.global.gpu.acq_rel.add.u{bits}"),
                               b.ptx.count(f"atom.global.gpu.relaxed.add.u{bits}"))
    assert atomics(build, 32) == (2, 1) and atomics(build, 64) == (0, 0)
    assert atomics(tuned, 32) == (0, 0) and atomics(tuned, 64) == (1, 1)
    assert len(build.loops()) == len(tuned.loops()) + 4


@pins_counts
def test_the_t64_launch_counts_tiles_monotonically_and_ends_without_a_launch_wide_count():
    # the tuned T=64 launch (co-resident, carried pre) runs MONOTONIC: a stage-A arrival is an
    # acq_rel add on its tile's u64 counter, a rescale job's ticket a relaxed one, sum(c^2) goes to
    # slots (32: the tile's 27 stage-A jobs rounded up), and nothing counts the launch's end or
    # restores a zero state; the claimed build keeps the u32 sync words, the claim and the end count
    # (relaxed adds), and the reset (two exchanges). Both reduce partial sums with one vector
    # red.add.v4.f32 a thread (its four consecutive tokens of a column: see the next test).
    spec = hopper_builds.mhc_spec("delayed")
    cfg = mega_mhc.choose_config(spec, 64, device="cuda")
    ops = lambda b: collections.Counter(re.findall(r"\b(?:atom|red)\.[\w.]+", b.ptx))
    tuned, claimed = (hopper_builds.build_mhc("delayed", 64, config=c)
                      for c in (cfg, dataclasses.replace(cfg, dispatch=mega_mhc.Dispatch.CLAIMED)))
    _check(tuned)
    assert tuned.constexprs["CSQ_SLOTS"] == 32 and claimed.constexprs["CSQ_SLOTS"] == 0
    assert ops(tuned) == {"red.global.gpu.relaxed.add.v4.f32": 1, "atom.global.gpu.acq_rel.add.u64": 1,
                          "atom.global.gpu.relaxed.add.u64": 1}
    assert ops(claimed) == {"red.global.gpu.relaxed.add.v4.f32": 1, "atom.global.gpu.acq_rel.add.u32": 1,
                            "atom.global.gpu.relaxed.add.u32": 2, "atom.global.gpu.relaxed.exch.b32": 2}


@pins_counts
@pytest.mark.parametrize("form", slow_beyond(list(hopper_builds.MHC_FORMS)))
@pytest.mark.parametrize("T", slow_beyond([1, 64, 512, 4096]))
def test_stage_a_adds_its_partial_sums_with_vector_atomics(form, T):
    # stage A's accumulator atomics are masked by quads of tokens (a mask constant over each
    # thread's four consecutive tokens of a column), so the tuned builds add them as one
    # red.add.v4.f32 a thread and sub-tile (the T=4096 row sweeps two), never as scalar adds:
    # on the H200 T=64 7.90 against 8.45 us in one instance. The one scalar add left is a fresh
    # collapse job's sum(c^2), a [TILE_T] vector masked per token.
    build = hopper_builds.build_mhc(form, T)
    _check(build)
    reds = collections.Counter(re.findall(r"\bred\.[\w.]+", build.ptx))
    expected = {"red.global.gpu.relaxed.add.v4.f32": build.constexprs["SUB_TILES"]}
    if hopper_builds.mhc_spec(form).pre == "fresh":
        expected["red.global.gpu.relaxed.add.f32"] = 1
    assert reds == expected


@pytest.mark.parametrize("T", slow_beyond([1, 64, 512]))
def test_a_pdl_launch_waits_for_its_predecessor_before_touching_memory(monkeypatch, T):
    # LaunchConfig.pdl as the H200 launches the seam (the launcher asks for it on CUDA devices from
    # sm_90 on, so this CPU build is made with it by hand): griddepcontrol.wait, then
    # launch_dependents, before the kernel's first global load, store or atomic; without pdl, neither.
    # Where jobs are claimed (T=512) the wait comes first, before the claim; where job = program id
    # (T=1 hand-off, T=64 co-resident) each role that touches memory (stage-A jobs, rescale jobs:
    # two) waits just before its first access, after the set-up from the program id (_begin)
    monkeypatch.setattr(mega_mhc, "pdl_options", lambda cfg, device: {"PDL": cfg.pdl})
    build = hopper_builds.build_mhc("delayed", T)
    _check(build)
    ptx = build.ptx
    first_access = min(m.start() for m in re.finditer(r"\b(?:ld|st|atom|red|cp\.async)\.(?!param)", ptx))
    waits = [m.start() for m in re.finditer(r"griddepcontrol\.wait", ptx)]
    assert waits[0] < ptx.index("griddepcontrol.launch_dependents") < first_access
    claimed = not (build.constexprs["CO_RESIDENT"] or build.constexprs["HANDOFF"])
    assert claimed == (T == 512)
    if claimed:
        assert len(waits) == 1 and "%ctaid.x" not in ptx[:waits[0]]
        assert ptx.index("atom.global", waits[0]) == min(m.start() for m in re.finditer(r"\batom\.", ptx))
    else:
        assert len(waits) == 2 and ptx.index("%ctaid.x") < waits[0]
    cfg = mega_mhc.choose_config(hopper_builds.mhc_spec("delayed"), T, device="cuda")
    assert "griddepcontrol" not in hopper_builds.build_mhc("delayed", T, config=dataclasses.replace(cfg, pdl=False)).ptx


@pins_counts
def test_sinkhorn_on_factors_takes_two_thirds_of_the_instructions_a_round_on_sm90():
    # the T=64 merge's Sinkhorn loop (SINKHORN_UNROLL rounds a trip): the same reciprocals (n row
    # and n column ones a round), and 48 instructions a round on factors against 72 on cells
    spec = hopper_builds.mhc_spec("delayed")
    cfg = mega_mhc.choose_config(spec, 64, device="cuda")
    loops = {}
    for factors in (False, True):
        build = hopper_builds.build_mhc("delayed", 64, config=dataclasses.replace(cfg, sinkhorn_factors=factors))
        [loops[factors]] = [loop for loop in build.loops() if loop.opcodes.get("MUFU")]
        assert loops[factors].opcodes["MUFU"] == 2 * 4 * mega_mhc.SINKHORN_UNROLL
    per_round = {k: loop.instructions / mega_mhc.SINKHORN_UNROLL for k, loop in loops.items()}
    assert per_round[True] <= 50 and per_round[False] >= 70, per_round


def test_resident_programs_of_a_device(monkeypatch):
    # a co-resident Mega-mHC launch needs the whole grid on the device at once: programs per SM from
    # the build's registers and shared memory, times the SMs; an architecture whose register and
    # block limits are not known here counts one program per SM (what any launchable kernel fits)
    props = lambda major: SimpleNamespace(major=major, minor=0, multi_processor_count=132, warp_size=32,
                                          shared_memory_per_multiprocessor=228 * 1024,
                                          max_threads_per_multi_processor=2048)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props(9))
    assert occupancy.resident_programs(225, 88064, 4, torch.device("cuda")) == 2 * 132  # the T=64 seam
    assert occupancy.resident_programs(128, 40960, 4, torch.device("cuda")) == 4 * 132
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props(7))
    assert occupancy.resident_programs(128, 40960, 4, torch.device("cuda")) == 132


def test_hopper_builds_tool_writes_one_row_per_kernel_and_token_count(tmp_path, capsys):
    out = tmp_path / "builds.json"
    assert hopper_builds.main(["--tokens", "64", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["schema"] == "megafuse.hopper_builds/1"
    kernels = len(hopper_builds.MHC_FORMS) + len(hopper_builds.GATE_INPUTS) + 2  # attention splits at T=64: + combine
    assert len(result["rows"]) == kernels and {r["tokens"] for r in result["rows"]} == {64}
    delayed = next(r for r in result["rows"] if r["form"] == "delayed")
    build = hopper_builds.build_mhc("delayed", 64)
    assert delayed == {**delayed, "op": "mega_mhc", "target": "cuda sm_90", "stack_bytes": 0,
                       "programs_per_sm": build.programs_per_sm(),
                       "largest_loop_instructions": build.loops()[0].instructions}
    with pytest.raises(SystemExit):
        hopper_builds.main(["--tokens", "0"])
    assert "--tokens must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("form", slow_beyond(["delayed", "fresh"]))
def test_reads_after_an_acquire_are_plain_loads(form):
    # What another program published (partial sums, the parked collapse, a fresh pre' and X') is
    # read after an acquire (the rescale's and collapse's spin, the last arrival's acq_rel atomic),
    # which orders it: plain loads suffice, where .cg loads became strong GPU-scope loads on sm_90
    # and are slower on the H200 (T=64 9.75 against 9.60 us).
    build = hopper_builds.build_mhc(form, 64)
    _check(build)
    assert re.search(r"ld\.global\.cg", build.ptx) is None
    # (the carried forms' T=64 launches count in u64 token-tile counters: MONOTONIC)
    bits = 64 if build.constexprs["CSQ_SLOTS"] else 32
    assert f"ld.global.gpu.acquire.b{bits}" in build.ptx and f"atom.global.gpu.acq_rel.add.u{bits}" in build.ptx
