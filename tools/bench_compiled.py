"""H200 benchmark through the compiler: what a user gets when `passes.compile` fuses their chain.

    python3 -m megafuse.tools.bench_compiled --out results/compiled/bench.json [--ops mhc,gate] [--tokens 1,64]
    python3 -m megafuse.tools.bench_compiled --dry-run     # CPU: toy widths, the checks of 1. only, no timings

The kernel benchmarks (tools.bench_mhc, tools.bench_gate) time a kernel on inputs they build. Here
each chain is written as plain torch, the way a reader of docs/model.md writes it (V4.1 widths), and
compiled three ways in one run: `passes.compile` (the megafuse passes), plain `torch.compile`
(default mode) and eager. For each T in {1, 64, 512, 4096}:

1. the pass report: the chain must fuse whole (one match, no rejection; the seam with its
   coefficient head), and the compiled output must equal eager (fp32 outputs; bf16 ones within bf16
   rounding; the gate's ids equal except at near-ties), on the first call and again on fresh
   inputs (which the launch the first call kept runs: lowering.launch);
2. medians of CUDA-graph replay (`do_bench_cudagraph`) of the three, and of back-to-back calls
   without graphs (`eager_call_us`: 200 calls, synchronised once, per call: the host's cost where
   it exceeds the GPU's), the number a program that does not capture graphs sees;
3. the fused op alone (the lowering's launcher, as the compiled graph calls it): graph replay and
   back-to-back calls, whose difference is the host cost of one launch outside CUDA graphs;
4. the memory floor: the chain's compulsory HBM bytes (the kernel benchmarks' formulas) / 4.3 TB/s.

Chains (the spellings of issue-style user code, not the project's model):
  mhc   bf16 streams X [T, 4, 5120], y [T, 5120]; fp32 fn, base, scale, norm weight; the post
        `comb^T @ X + post * y`, coefficients `(x @ fn.t()) * rsqrt(mean(x^2) + eps)` sliced into
        pre / post / comb, Sinkhorn as a loop of 20 rounds, the collapse `(pre[..., None] * X).sum(-2)`,
        RMSNorm.
  gate  fp32 u [T, 5120] @ W^T (W [384, 5120] fp32), sqrt(softplus), + bias, top-6, gather,
        renormalise, x1.5.
  moe   the model's own routed experts (model.moe.Experts) at flash-lite's widths: bf16 u [T, 5120],
        24 experts of width 2304, top-6 of a seeded routing, MXFP8 inputs (quant="ref"); its floor
        is max(bytes / HBM, FLOPs / the bf16 MMA rate): the min(E, 6T) experts' weights a call reads,
        and 2 x 3 x D x F FLOPs a slot.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from megafuse import passes
from megafuse.model import preset
from megafuse.model.moe import Experts
from megafuse.tools.bench_common import BF16_FLOPS, HBM_BYTES_PER_S, Stages, default_out, require_cuda, time_graph_us

TOKENS = (1, 64, 512, 4096)
HC, DIM, EXPERTS, TOP_K, SINKHORN_ITERS = 4, 5120, 384, 6, 20
DRY_RUN = dict(dim=64, experts=64, iters=3, tokens=(1, 16))  # the interpreter: toy widths, two T
EAGER_CALLS = 200


class PlainSeam(nn.Module):
    """The mHC seam (docs/model.md section 3) as plain torch: previous post, coefficients, collapse, norm."""

    def __init__(self, n: int, dim: int, iters: int = 20, eps: float = 1e-6):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.n, self.iters, self.eps = n, iters, eps
        self.fn = nn.Parameter(torch.randn((2 + n) * n, n * dim, generator=g) * (0.1 / (n * dim) ** 0.5))
        self.base = nn.Parameter(torch.randn((2 + n) * n, generator=g) * 0.5)
        self.scale = nn.Parameter(torch.ones(3))
        self.norm_weight = nn.Parameter(torch.rand(dim, generator=g) + 0.5)

    def forward(self, X, y, post, comb, carried_pre):
        n, eps = self.n, self.eps
        X = (comb.transpose(-1, -2) @ X.float() + post.unsqueeze(-1) * y.float().unsqueeze(-2)).to(X.dtype)
        x = X.flatten(-2).float()
        m = (x @ self.fn.t()) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        pre = torch.sigmoid(m[..., :n] * self.scale[0] + self.base[:n]) + eps
        post_next = 2 * torch.sigmoid(m[..., n:2 * n] * self.scale[1] + self.base[n:2 * n])
        c = (m[..., 2 * n:] * self.scale[2] + self.base[2 * n:]).unflatten(-1, (n, n))
        c = torch.softmax(c, -1) + eps
        c = c / (c.sum(-2, keepdim=True) + eps)
        for _ in range(self.iters - 1):
            c = c / (c.sum(-1, keepdim=True) + eps)
            c = c / (c.sum(-2, keepdim=True) + eps)
        collapsed = (carried_pre[..., None] * X.float()).sum(-2).to(X.dtype).float()
        u = collapsed * torch.rsqrt(collapsed.pow(2).mean(-1, keepdim=True) + eps) * self.norm_weight
        return X, u.to(X.dtype), pre, post_next, c

    def inputs(self, T: int, device, seed: int):
        g = torch.Generator().manual_seed(seed)
        n, dim = self.n, self.norm_weight.shape[0]
        comb = torch.softmax(torch.randn(T, n, n, generator=g), -1)
        return tuple(t.to(device) for t in (
            torch.randn(T, n, dim, generator=g).bfloat16(), torch.randn(T, dim, generator=g).bfloat16(),
            2 * torch.rand(T, n, generator=g), comb / comb.sum(-2, keepdim=True),
            torch.rand(T, n, generator=g) + 0.5))


class PlainRouter(nn.Module):
    """V4.1's MoE router as plain torch: fp32 GEMM, sqrt(softplus), selection bias, top-k, renorm."""

    def __init__(self, experts: int, dim: int, k: int, scale: float = 1.5):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(torch.randn(experts, dim, generator=g) / dim ** 0.5)
        self.bias = nn.Parameter(torch.randn(experts, generator=g) * 0.05)
        self.k, self.scale = k, scale

    def forward(self, u):
        scores = torch.sqrt(F.softplus(u.float() @ self.weight.t()))
        ids = torch.topk(scores + self.bias, self.k, dim=-1).indices
        weights = scores.gather(-1, ids)
        return weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.scale, ids

    def inputs(self, T: int, device, seed: int):
        return (torch.randn(T, self.weight.shape[1], generator=torch.Generator().manual_seed(seed)).to(device),)


class RoutedExperts(nn.Module):
    """The model's routed experts (model.moe.Experts, the module Mega-MoE matches) of config `cfg`,
    fed a seeded routing: (u, weights, ids) -> [T, D]."""

    def __init__(self, cfg):
        super().__init__()
        torch.manual_seed(0)
        self.cfg, self.experts = cfg, Experts(cfg, torch.bfloat16)

    def forward(self, u, weights, ids):
        return self.experts(u, weights, ids)

    def inputs(self, T: int, device, seed: int):
        g, cfg = torch.Generator().manual_seed(seed), self.cfg
        ids = torch.rand(T, cfg.n_experts, generator=g).topk(cfg.n_active_experts, dim=-1).indices
        weights = torch.rand(T, cfg.n_active_experts, generator=g) + 0.1
        u = torch.randn(T, cfg.dim, generator=g).bfloat16()
        return tuple(t.to(device) for t in (u, weights / weights.sum(-1, keepdim=True), ids))


# flash-lite's routed experts; the dry run's: tiny's widths with flash-lite's rules
MOE_CONFIG = {False: preset("flash-lite"), True: preset("tiny").replace(quant="ref")}


def chain(op: str, dry_run: bool) -> nn.Module:
    """The chain at V4.1 widths, or at the dry run's."""
    dim = DRY_RUN["dim"] if dry_run else DIM
    if op == "mhc":
        return PlainSeam(HC, dim, iters=DRY_RUN["iters"] if dry_run else SINKHORN_ITERS)
    if op == "moe":
        return RoutedExperts(MOE_CONFIG[dry_run])
    return PlainRouter(DRY_RUN["experts"] if dry_run else EXPERTS, dim, TOP_K)


CHAINS = {"mhc": "mega_mhc", "gate": "mega_gate", "moe": "mega_moe"}  # op -> its pass


def moe_floor(cfg, T: int) -> tuple[int, int]:
    """(bytes, FLOPs) a call of the routed experts must read and do: the weights of the min(E, T k)
    experts it can touch (bf16), u and the output (bf16), the routing (fp32 weights, int64 ids)."""
    D, F_, k = cfg.dim, cfg.expert_dim, cfg.n_active_experts
    nbytes = min(cfg.n_experts, T * k) * 3 * D * F_ * 2 + 2 * T * D * 2 + T * k * (4 + 8)
    return nbytes, 2 * T * k * 3 * D * F_


def floor_us(op: str, T: int) -> float:
    """The chain's floor at V4.1 widths: its compulsory HBM bytes / HBM bandwidth (and for the
    experts, the larger of that and their FLOPs / the bf16 MMA rate)."""
    if op == "mhc":
        from megafuse.tools.bench_mhc import V41, seam_bytes
        nbytes = seam_bytes(T, V41)
    elif op == "moe":
        nbytes, flops = moe_floor(MOE_CONFIG[False], T)
        return max(nbytes / HBM_BYTES_PER_S, flops / BF16_FLOPS) * 1e6
    else:
        from megafuse.tools.bench_gate import V4, gate_bytes
        nbytes = gate_bytes(V4, T)
    return nbytes / HBM_BYTES_PER_S * 1e6


def eager_call_us(fn, calls: int = EAGER_CALLS) -> float:
    """Per call, for back-to-back calls without CUDA graphs, synchronised once at the end."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def _errors(op: str, got, ref) -> dict:
    if op == "moe":
        return {"out": ((got.float() - ref.float()).norm() / ref.float().norm()).item()}
    if op == "gate":
        (w, ids), (w_ref, ids_ref) = got, ref
        return {"ids_equal_fraction": (ids.sort(-1).values == ids_ref.sort(-1).values).all(-1).float().mean().item(),
                "weights_rel_err": ((w - w_ref).norm() / w_ref.norm()).item()}
    return {name: ((a.float() - b.float()).norm() / b.float().norm()).item()
            for name, a, b in zip(("X", "u", "pre", "post", "comb"), got, ref)}


def _fused_op_call(fused_module, op: str, args):
    """The fused op alone, called with the arguments the compiled graph gave the lowering's
    launcher on one call of the chain (recorded there): (graph us, back-to-back us)."""
    import importlib
    lowering = importlib.import_module(f"megafuse.lowering.mega_{op}")
    launcher, seen = getattr(lowering, f"mega_{op}"), []

    def record(*a, **kw):
        seen.append((a, kw))
        return launcher(*a, **kw)

    setattr(lowering, f"mega_{op}", record)
    try:
        fused_module(*args)
    finally:
        setattr(lowering, f"mega_{op}", launcher)
    if len(seen) != 1:
        raise RuntimeError(f"bench_compiled: the compiled {op} chain called the launcher {len(seen)} times, not once")
    (a, kw), = seen
    call = lambda: launcher(*a, **kw)  # noqa: E731
    return time_graph_us(call), eager_call_us(call)


def bench_chain(op: str, T: int, log, dry_run: bool = False) -> dict:
    pass_name, device = CHAINS[op], "cpu" if dry_run else "cuda"
    module = chain(op, dry_run).to(device)
    args = module.inputs(T, device, seed=T)
    with torch.no_grad():
        torch._dynamo.reset()
        fused = passes.compile(module, passes=[pass_name], dynamic=False)
        t0 = time.time()
        got = fused(*args)
        compile_s = time.time() - t0
        ref = module(*args)
        report = fused.report
        r = {"T": T, "compile_s": round(compile_s, 1), "counts": report.counts(),
             "specs": [m.spec for m in report.matches(pass_name)],
             "rejections": [str(x) for x in report.rejections(pass_name)],
             "errors": _errors(op, got, ref)}
        whole = report.counts().get(pass_name) == 1 and not r["rejections"]
        if op == "mhc":
            whole = whole and all(s["has_coefficients"] and s["has_post"] for s in r["specs"])
        r["fused_whole"] = whole
        # the same layout again on fresh inputs: the launch the first call kept (lowering.launch)
        fresh = module.inputs(T, device, seed=T + 1)
        r["errors_repeat"] = _errors(op, fused(*fresh), module(*fresh))
        if dry_run:
            log(f"{op} T={T}: whole {whole} {r['counts']}; errors {r['errors']}; repeat {r['errors_repeat']}")
            return r
        plain = torch.compile(module, dynamic=False)
        plain(*args)
        r["fused_graph_us"] = time_graph_us(lambda: fused(*args))
        r["compile_graph_us"] = time_graph_us(lambda: plain(*args))
        r["eager_graph_us"] = time_graph_us(lambda: module(*args))
        r["fused_eager_call_us"] = eager_call_us(lambda: fused(*args))
        r["compile_eager_call_us"] = eager_call_us(lambda: plain(*args))
        if whole:
            r["op_graph_us"], r["op_eager_call_us"] = _fused_op_call(fused, op, args)
            r["op_launch_overhead_us"] = r["op_eager_call_us"] - r["op_graph_us"]
    r["floor_us"] = floor_us(op, T)
    r["fused_over_floor"] = r["fused_graph_us"] / r["floor_us"]
    r["speedup_vs_compile_graph"] = r["compile_graph_us"] / r["fused_graph_us"]
    r["speedup_vs_compile_eager_call"] = r["compile_eager_call_us"] / r["fused_eager_call_us"]
    log(f"{op} T={T}: whole {r['fused_whole']} {r['counts']}  graph fused {r['fused_graph_us']:.2f} / compile "
        f"{r['compile_graph_us']:.2f} / eager {r['eager_graph_us']:.2f} us ({r['speedup_vs_compile_graph']:.2f}x, "
        f"floor {r['floor_us']:.2f}); "
        f"no graphs fused {r['fused_eager_call_us']:.2f} / compile {r['compile_eager_call_us']:.2f} us; "
        f"op launch overhead {r.get('op_launch_overhead_us', float('nan')):.2f} us; errors {r['errors']}")
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m megafuse.tools.bench_compiled", description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="the results JSON (default results/compiled/bench.json)")
    ap.add_argument("--ops", default=",".join(CHAINS), help=f"comma-separated: {', '.join(CHAINS)} (default: all)")
    ap.add_argument("--tokens", help=f"comma-separated token counts (default {','.join(map(str, TOKENS))}; "
                                     f"dry run {','.join(map(str, DRY_RUN['tokens']))})")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, toy widths: that each chain fuses whole and equals eager, no timings")
    args = ap.parse_args(argv)
    require_cuda(ap, dry_run=args.dry_run)
    ops = args.ops.split(",")
    unknown = [o for o in ops if o not in CHAINS]
    if unknown:
        ap.error(f"unknown ops {unknown}; valid: {', '.join(CHAINS)}")
    out = args.out or default_out("compiled", args.dry_run)
    try:
        tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else \
            list(DRY_RUN["tokens"] if args.dry_run else TOKENS)
    except ValueError:
        ap.error(f"--tokens takes comma-separated positive integers, not {args.tokens!r}")
    if any(t < 1 for t in tokens):
        ap.error(f"--tokens takes comma-separated positive integers, not {args.tokens!r}")
    log_file = open(out.removesuffix(".json") + ".log", "w")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)
        print(msg, file=log_file, flush=True)

    import triton
    results = {"date": datetime.date.today().isoformat(),
               "device": "cpu (Triton interpreter)" if args.dry_run else torch.cuda.get_device_name(),
               "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
               "eager_calls": EAGER_CALLS}
    stages = Stages(results, out, log)
    for op in ops:
        for T in tokens:
            stages.run(f"{op}_T{T}", lambda op=op, T=T: bench_chain(op, T, log, args.dry_run))
    rows = [(k, v) for k, v in results.items() if isinstance(v, dict) and "fused_graph_us" in v]
    print(f"{'chain':10s} {'whole':5s} {'fused':>8s} {'compile':>8s} {'x':>6s} {'floor':>7s} {'no-graph fused':>14s} "
          f"{'no-graph compile':>16s} {'op overhead':>11s}")
    for name, r in rows:
        print(f"{name:10s} {str(r['fused_whole']):5s} {r['fused_graph_us']:8.2f} {r['compile_graph_us']:8.2f} "
              f"{r['speedup_vs_compile_graph']:6.2f} {r['floor_us']:7.2f} {r['fused_eager_call_us']:14.2f} {r['compile_eager_call_us']:16.2f} "
              f"{r.get('op_launch_overhead_us', float('nan')):11.2f}")
    json.dump(results, open(out, "w"), indent=1, default=str)
    chains = [v for v in results.values() if isinstance(v, dict) and "fused_whole" in v]
    failed = [name for name, stage in results["stages"].items() if not stage["ok"]]
    partial = [f"{r['T']}" for r in chains if not r["fused_whole"]]
    if failed or partial:
        log(f"FAILED: stages {failed} raised; chains not fused whole at T = {partial} (see {out})")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
