"""Build the proxy model's fused kernels for Hopper (sm_90) without a GPU; print their resources.

    python3 -m megafuse.tools.hopper_builds [--tokens 1,64,512,4096] [--json PATH]

For each kernel the proxy model launches (the Mega-mHC seam forms it has, plus V4's fresh form,
the Mega-Gate at bf16 and fp32 inputs, MegaAttention at V4's widths with its combine where the
launch splits the keys) and each token count, the launcher's CUDA launch
configuration is compiled ahead of time (`lowering.offline.build_launch`: PTX and cubin with the
ptxas in Triton's wheel) and the table gives registers per thread, stack / local bytes (spills),
shared memory, warps, stages, the programs one SM holds at once (`Build.programs_per_sm`): what
decides occupancy, known before any GPU time is spent; and the instructions of the kernel's
largest loop (`Build.loops`: for a Mega-mHC seam whose stage-A jobs take several chunks, as at
T >= 64 here, one stage-A chunk; a one-chunk job, as at T = 1, has no chunk loop, and the column
then shows the next-largest loop). The
H200's own builds (results/tools/inspect_proxy.json, T = 64, the tuned launch configurations,
before Mega-mHC converted bf16 in pairs) reported 243 registers / 45056 B for the delayed seam,
168 / 43008 B for the first seam, 128 / 22528 B for the final collapse and 217 / 40960 B for the
gate, where this built 246, 168, 130 and 217 registers with the same shared memory (Triton 3.6
there, this machine's Triton here); it now builds 225, 178, 241 and 217 (T=64's row now takes
three chunks per stage-A job, pipelined 3 deep, and its rescale jobs two column blocks each: two
[16, 512] blocks in flight, which in fp32 are the final collapse's peak). A build, not a
measurement: no timings.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys

import torch
from rich.table import Table

from megafuse.lowering import mega_attention, mega_gate, mega_mhc, offline

from .output import console, environment, write_json

D, N, EXPERTS, TOP_K = 5120, 4, 384, 6  # proxy / V4.1-Flash widths
HEADS, HEAD_DIM, ROPE_DIM, ATTENDED = 64, 512, 64, 128 + 512  # V4.1-Flash attention: SWA window + top-k rows
H200_SMS = 132
TOKENS = (1, 64, 512, 4096)

# the seam forms the proxy model has (results/tools/inspect_proxy.json) and V4's fresh pre
MHC_FORMS = {
    "delayed": dict(has_post=True, has_coefficients=True, pre="carried", stream_dtype="bfloat16"),
    "first": dict(has_post=False, has_coefficients=True, pre="carried", stream_dtype="bfloat16"),
    "final, fp32 streams": dict(has_post=True, has_coefficients=False, pre="carried", stream_dtype="float32"),
    "fresh": dict(has_post=True, has_coefficients=True, pre="fresh", stream_dtype="bfloat16"),
}
GATE_INPUTS = ("bfloat16", "float32")


def mhc_spec(form: str) -> mega_mhc.MhcSpec:
    fields = MHC_FORMS[form]
    return mega_mhc.MhcSpec(n=N, dim=D, sinkhorn_iters=20 if fields["has_coefficients"] else 0, hc_eps=1e-6,
                            stat_eps=1e-20, norm_eps=1e-20, **fields)


def mhc_inputs(spec: mega_mhc.MhcSpec, T: int) -> tuple:
    """mega_mhc's inputs for T tokens on the CPU (zeros: a build reads only their dtypes and strides)."""
    f32 = dict(dtype=torch.float32)
    n, dim = spec.n, spec.dim
    return (torch.zeros(T, n, dim, dtype=mega_mhc.DTYPES[spec.stream_dtype]), torch.zeros(T, dim, dtype=torch.bfloat16),
            torch.zeros(T, n, **f32), torch.zeros(T, n, n, **f32), torch.zeros(T, n, **f32),
            torch.zeros(spec.width(), n * dim, **f32), torch.zeros(spec.width(), **f32), torch.zeros(3, **f32),
            torch.ones(dim, **f32))


def build_mhc(form: str, T: int, config: mega_mhc.LaunchConfig | None = None) -> offline.Build:
    """The seam kernel of `form` as the H200 would launch it for T tokens (y in bf16: the model's),
    or with `config` instead of the tuned launch configuration."""
    spec = mhc_spec(form)
    return h200_build(mega_mhc, mega_mhc.mega_mhc, *mhc_inputs(spec, T), spec,
                      config=config or mega_mhc.choose_config(spec, T, device="cuda"))


def h200_build(module, launcher, *args, config, **kwargs) -> offline.Build:
    """`offline.build_kernel` of a launch as the H200 runs it. For Mega-mHC that is the co-resident
    build only where its launcher would pick it there (`mega_mhc.fits_at_once`: a
    `co_resident_candidate` grid that the build's occupancy holds), else the build whose jobs are
    claimed."""
    claimed = {"dispatch": mega_mhc.Dispatch.CLAIMED}
    if module is mega_mhc and config.dispatch is mega_mhc.Dispatch.RESIDENT:
        spec = next(a for a in args if isinstance(a, mega_mhc.MhcSpec))
        if not mega_mhc.co_resident_candidate(mega_mhc.plan(spec, config, args[0].shape[0])["n_jobs"], H200_SMS):
            config = dataclasses.replace(config, **claimed)
    build = offline.build_kernel(module, launcher, *args, config=config, **kwargs)
    if build.constexprs.get("CO_RESIDENT") and build.grid[0] > build.programs_per_sm() * H200_SMS:
        build = offline.build_kernel(module, launcher, *args, config=dataclasses.replace(config, **claimed), **kwargs)
    return build


def gate_spec(input_dtype: str) -> mega_gate.GateSpec:
    return mega_gate.GateSpec(n_experts=EXPERTS, hidden=D, k=TOP_K, score_func="sqrtsoftplus", has_bias=True,
                              renorm=True, renorm_eps=1e-20, scale=1.5, input_dtype=input_dtype, weight_dtype="float32")


def build_gate(input_dtype: str, T: int) -> offline.Build:
    """The gate kernel as the H200 would launch it for T tokens of `input_dtype`."""
    spec = gate_spec(input_dtype)
    u = torch.zeros(T, D, dtype=mega_gate.DTYPES[input_dtype])
    return offline.build_kernel(mega_gate, mega_gate.mega_gate, u, torch.zeros(EXPERTS, D), torch.zeros(EXPERTS),
                                spec, config=mega_gate.choose_config(spec, T, device="cuda"))


ATTENTION_SPEC = mega_attention.AttentionSpec(heads=HEADS, head_dim=HEAD_DIM, rope_dim=ROPE_DIM, scale=HEAD_DIM ** -0.5,
                                              key_dtype="bfloat16", out_dtype="bfloat16", mxfp8=False, q_rope=True)


def build_attention(T: int) -> list[offline.Build]:
    """MegaAttention's launches for T query rows (bf16, the pass's spec at V4 widths): the kernel,
    and its combine where the launch splits the keys."""
    spec, bf16 = ATTENTION_SPEC, dict(dtype=torch.bfloat16)
    inputs = (torch.zeros(T, HEADS, HEAD_DIM, **bf16), torch.zeros(T, ATTENDED, HEAD_DIM, **bf16),
              torch.zeros(T, ATTENDED, dtype=torch.bool), torch.zeros(HEADS), torch.zeros(T, ROPE_DIM // 2))
    config = mega_attention.choose_config(spec, T, ATTENDED, device="cuda")  # the GPU's, not the CPU's
    return offline.build_launch(mega_attention, mega_attention.mega_attention, *inputs, spec, config)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts (default %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON ('-' for stdout)")
    args = parser.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens must be comma-separated integers, got {args.tokens!r}")
    if any(t < 1 for t in tokens):
        parser.error("--tokens must be >= 1")
    jobs = [("mega_mhc", form, lambda T, f=form: [build_mhc(f, T)]) for form in MHC_FORMS]
    jobs += [("mega_gate", f"{dtype} input", lambda T, d=dtype: [build_gate(d, T)]) for dtype in GATE_INPUTS]
    jobs += [("mega_attention", f"bf16, {ATTENDED} keys", build_attention)]
    rows = []
    with console.status("building for sm_90 ...") if console.is_terminal else contextlib.nullcontext():
        for op, form, build in jobs:
            for T in tokens:
                for b in build(T):
                    loops = b.loops()
                    rows.append({"op": op, "form": form if b.name != mega_attention.COMBINE_NAME else f"{form}: combine",
                                 "tokens": T, "grid": math.prod(b.grid), "registers": b.registers,
                                 "stack_bytes": b.stack_bytes, "shared_bytes": b.shared_bytes,
                                 "num_warps": b.num_warps, "num_stages": b.num_stages,
                                 "programs_per_sm": b.programs_per_sm(),
                                 "largest_loop_instructions": loops[0].instructions if loops else None,
                                 "target": b.target})
    table = Table(title=f"fused kernels built for {rows[0]['target']} (no GPU), CUDA launch configurations")
    for col in ("op", "form", "T", "programs", "regs", "stack/local B", "smem B", "warps", "stages", "per SM",
                "loop instr"):
        table.add_column(col, justify="left" if col in ("op", "form") else "right")
    for r in rows:
        table.add_row(r["op"], r["form"], str(r["tokens"]), str(r["grid"]), str(r["registers"]), str(r["stack_bytes"]),
                      str(r["shared_bytes"]), str(r["num_warps"]), str(r["num_stages"]), str(r["programs_per_sm"]),
                      str(r["largest_loop_instructions"]))
    console.print(table)
    if args.json:
        write_json({"schema": "megafuse.hopper_builds/1", "rows": rows, "environment": environment()}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
