"""H200 benchmark of MegaAttention's kernel (lowering/mega_attention.py) against the chain it replaces.

    python3 -m megafuse.tools.bench_attention [--tokens 1,16,64,128,512,4096] [--splits 1,2,4,8,16]
                                              [--out PATH] [--dry-run]

V4.1-Flash attention: 64 heads x 512, a 64-dim RoPE tail, 640 keys per query row (128 SWA + 512
global rows), bf16 q and keys, one sink per head, bf16 out. The chain is `mega_attention.reference`
(the model's RoPE of q, sparse attention with the sink in fp32, inverse RoPE, the cast): what the
pass replaces. The kernel reads keys already gathered and decoded; the gathers and the FP8 / FP4 decodes
stay outside both sides of the comparison. For each T (query rows):

1. correctness first: the kernel against the chain on random inputs (70% of keys valid, row 0
   with none where T > 1), every split count it would choose and others, relative to the output's scale; NaN never passes;
2. CUDA-graph medians (`triton.testing.do_bench_cudagraph`): the kernel with its own launch
   (`choose_config`), the chain under `torch.compile` (default mode) and eager;
3. roofline floor = max(bytes / 4.3 TB/s, FLOPs / 660 TFLOP/s) with bytes = T (J D 2 + 2 H D 2 + J)
   (keys, q and out, the mask) and FLOPs = 4 T H J D (two GEMMs), and the practical floor
   max(floor, 4 us); the ratios against the issue's targets.

`--splits` also times each forced key split per T (the data behind `choose_config`'s split). For
reference, not as a claim: vLLM's published GB300 MegaAttention times (64 heads) are listed beside.
`--dry-run` runs the correctness part on CPU through the Triton interpreter at toy sizes (no
timings; its JSON goes to a temp file unless --out names one: results/ holds H200 runs).
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import triton

from megafuse.lowering import mega_attention as ma
from megafuse.tools.bench_common import BF16_FLOPS, HBM_BYTES_PER_S, Stages, default_out, open_log, require_cuda, time_graph_us
from megafuse.tools.common import positive_ints

V4 = ma.AttentionSpec(heads=64, head_dim=512, rope_dim=64, scale=512 ** -0.5, key_dtype="bfloat16",
                      out_dtype="bfloat16", mxfp8=False, q_rope=True)
KEYS = 128 + 512
TOY = ma.AttentionSpec(heads=4, head_dim=64, rope_dim=16, scale=64 ** -0.5, key_dtype="bfloat16",
                       out_dtype="bfloat16", mxfp8=False, q_rope=True)
TOY_KEYS = 100
TOKENS = (1, 16, 64, 128, 512, 4096)
LAUNCH_FLOOR_US = 4.0
TOLERANCE = 1e-2  # bf16 output: the chain rounds the same fp32 value
TARGET_VS_COMPILE = {1: 4.0, 64: 10.0}
TARGET_X_FLOOR = {t: 2.0 for t in (1, 16, 64, 128)} | {512: 1.5, 4096: 1.5}
# vLLM's published GB300 MegaAttention (64 heads, us by query tokens), for reference only
PUBLISHED_GB300_US = {1: 29, 32: 31, 128: 31, 256: 53, 512: 96}


def make_inputs(spec: ma.AttentionSpec, T: int, n_keys: int, device, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    dtype = ma.DTYPES[spec.key_dtype]
    q = torch.randn(T, spec.heads, spec.head_dim, generator=g).to(dtype)
    keys = torch.randn(T, n_keys, spec.head_dim, generator=g).to(dtype)
    valid = torch.rand(T, n_keys, generator=g) < 0.7
    if T > 1:
        valid[0] = False  # no valid key: the output is exactly 0
    sink = torch.randn(spec.heads, generator=g)
    angles = torch.rand(T, spec.rope_dim // 2, generator=g) * 1000.0
    return tuple(t.to(device) for t in (q, keys, valid, sink, angles))


def attention_bytes(spec: ma.AttentionSpec, T: int, n_keys: int) -> int:
    element = ma.DTYPES[spec.key_dtype].itemsize
    return T * (n_keys * spec.head_dim * element + 2 * spec.heads * spec.head_dim * element + n_keys)


def attention_flops(spec: ma.AttentionSpec, T: int, n_keys: int) -> int:
    return 4 * T * spec.heads * n_keys * spec.head_dim


def check(spec: ma.AttentionSpec, inputs: tuple, config: ma.LaunchConfig | None = None) -> dict:
    got = ma.mega_attention(*inputs, spec, config).float()
    want = ma.reference(*inputs, spec).float()
    rel = float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))
    first_row_zero = bool((got[0] == 0).all()) or inputs[2].shape[0] == 1  # make_inputs: row 0 of T > 1
    return {"rel_err": rel, "first_row_zero": first_row_zero,
            "ok": rel <= TOLERANCE and first_row_zero and bool(torch.isfinite(got).all())}


def correctness(spec: ma.AttentionSpec, n_keys: int, tokens, device, log) -> list:
    rows = []
    for T in tokens:
        inputs = make_inputs(spec, T, n_keys, device, seed=T)
        config = ma.choose_config(spec, T, n_keys)
        for splits in sorted({1, config.splits, min(3, config.splits + 2)}):
            forced = ma.choose_config(spec, T, n_keys, splits, device=inputs[0].device.type)
            row = {"T": T, "splits": splits, **check(spec, inputs, forced)}
            log(f"  T={T} splits={splits}: rel err {row['rel_err']:.2e} {'ok' if row['ok'] else 'BAD'}")
            rows.append(row)
    return rows


def bench_T(T: int, device, log) -> dict:
    inputs = make_inputs(V4, T, KEYS, device, seed=T)
    config = ma.choose_config(V4, T, KEYS)
    r = {"T": T, "config": config.__dict__.copy(), "check": check(V4, inputs)}
    chain = lambda *x: ma.reference(*x, V4)  # noqa: E731
    compiled = torch.compile(chain, dynamic=False)
    compiled(*inputs)  # compile outside the timed region
    r["fused_graph_us"] = time_graph_us(lambda: ma.mega_attention(*inputs, V4))
    r["compile_graph_us"] = time_graph_us(lambda: compiled(*inputs))
    r["eager_graph_us"] = time_graph_us(lambda: chain(*inputs))
    nbytes, flops = attention_bytes(V4, T, KEYS), attention_flops(V4, T, KEYS)
    floor_mem, floor_flop = nbytes / HBM_BYTES_PER_S * 1e6, flops / BF16_FLOPS * 1e6
    r.update(bytes=nbytes, flops=flops, floor_mem_us=floor_mem, floor_flop_us=floor_flop,
             floor_us=max(floor_mem, floor_flop))
    r["speedup_vs_compile"] = r["compile_graph_us"] / r["fused_graph_us"]
    r["speedup_vs_eager"] = r["eager_graph_us"] / r["fused_graph_us"]
    r["x_of_practical_floor"] = r["fused_graph_us"] / max(r["floor_us"], LAUNCH_FLOOR_US)
    r["target_vs_compile"] = TARGET_VS_COMPILE.get(T)
    r["target_x_floor"] = TARGET_X_FLOOR.get(T)
    log(f"  T={T}: fused {r['fused_graph_us']:.2f} us ({config.splits} splits), compile "
        f"{r['compile_graph_us']:.2f}, eager {r['eager_graph_us']:.2f}, floor {r['floor_us']:.2f}")
    return r


def sweep_T(T: int, splits: tuple[int, ...], device, log) -> list:
    inputs = make_inputs(V4, T, KEYS, device, seed=T)
    rows = []
    for s in splits:
        config = ma.choose_config(V4, T, KEYS, splits=s)
        us = time_graph_us(lambda: ma.mega_attention(*inputs, V4, config))
        rows.append({"splits": config.splits, "keys_per_split": config.keys_per_split, "graph_us": us,
                     "check": check(V4, inputs, config)})
        log(f"  T={T} splits={config.splits}: {us:.2f} us")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m megafuse.tools.bench_attention", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="the results JSON (default results/mega_attention/bench.json; --dry-run: a temp file)")
    ap.add_argument("--tokens", type=positive_ints, default=TOKENS, help="query rows (default 1,16,64,128,512,4096)")
    ap.add_argument("--splits", type=positive_ints, help="also time these forced key splits at every T")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, toy sizes, no timings")
    args = ap.parse_args(argv)
    require_cuda(ap, args.dry_run)
    args.out = args.out or default_out("mega_attention", args.dry_run)
    log = open_log(args.out)

    device = torch.device("cpu" if args.dry_run else "cuda")
    spec, n_keys = (TOY, TOY_KEYS) if args.dry_run else (V4, KEYS)
    res = {"schema": "megafuse.bench_attention/1",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
           "spec": spec.describe(), "keys_per_row": n_keys, "hbm_bytes_per_s": HBM_BYTES_PER_S,
           "bf16_tflops": BF16_FLOPS / 1e12, "launch_floor_us": LAUNCH_FLOOR_US,
           "published_gb300_us_for_reference": PUBLISHED_GB300_US, "stages": {}}
    stages = Stages(res, args.out, log)
    stages.run("correctness", lambda: correctness(spec, n_keys, (1, 3) if args.dry_run else args.tokens, device, log))
    if not args.dry_run:
        res["results"] = []
        for T in args.tokens:
            stages.run(f"bench_T{T}", lambda T=T: bench_T(T, device, log))
            if res.get(f"bench_T{T}"):
                res["results"].append(res.pop(f"bench_T{T}"))
            if args.splits:
                stages.run(f"sweep_T{T}", lambda T=T: sweep_T(T, args.splits, device, log))
        stages.save()
        log(f"{res['device']}  torch {res['torch']}  triton {res['triton']}")
        log(f"{'T':>5} {'fused':>8} {'compile':>8} {'eager':>8} {'floor':>7} {'xCompile':>8} {'xEager':>7} {'xFloor':>7}")
        for r in res["results"]:
            log(f"{r['T']:>5} {r['fused_graph_us']:8.2f} {r['compile_graph_us']:8.2f} {r['eager_graph_us']:8.2f} "
                f"{r['floor_us']:7.2f} {r['speedup_vs_compile']:8.2f} {r['speedup_vs_eager']:7.2f} "
                f"{r['x_of_practical_floor']:7.2f}")
    bad = [r for r in res.get("correctness") or [] if not r["ok"]]
    log(f"correctness: {len(res.get('correctness') or [])} checks, {len(bad)} failed")
    return 1 if bad or not res.get("correctness") else 0


if __name__ == "__main__":
    sys.exit(main())
