"""The step's fp32 GEMMs against their tensor-core alternatives: error against fp64, and time.

    python3 -m megafuse.tools.bench_fp32_gemms --config flash-lite --context 27648
    python3 -m megafuse.tools.bench_fp32_gemms --config tiny --context 64 --dry-run   # CPU

The GEMMs the model keeps in fp32 (docs/model.md), at the preset's widths, with operands formed as
the model forms them:
- `compressor`: a ratio-2 compressor's two projections as one [T, D] x [2 Dh, D]^T GEMM; the input
  is the model's bf16 residual widened (exact in bf16), the weights are full fp32;
- `indexer`: the index logits of T query rows against the keys of a `--context` (one entry per
  `ratio` tokens), [T H, d] x [N, d]^T; under quant "ref" both operands are MXFP4-rounded (two
  significant bits, exact in bf16).

Each GEMM runs at each T of `--tokens` four ways:
- `fp32`: cuBLAS in fp32 on CUDA cores (`allow_tf32` off): the release's arithmetic;
- `tf32`: the same call with `allow_tf32` on (10-bit significands into the MMA);
- `bf16x3`: each operand split into bf16 hi + lo, three bf16 MMAs (hi hi, hi lo, lo hi) with fp32
  output (model.transformer.head_logits, the `mm.dtype` call): about 16 significant bits a product;
- `bf16`: both operands rounded to bf16, one MMA with fp32 output: exact products where the
  operands are bf16 values already;
- `bf16_w3` (where `a` is bf16 values, the compressor): b split into three bf16 parts whose sum is b
  (24 significant bits), three MMAs a x part: the exact products of fp32, summed in another order.

Per variant: the relative error against the same operands in fp64 (Frobenius), the time (CUDA-graph
replay median; weight splits made once, activation casts and splits inside the call), and
`within_release`: its error at most 2x fp32's (the release's own precision: the same products summed
in another order stay within that). `exact_in_bf16` says whether both operands are bf16 values.

JSON (`--out`, default results/fp32_gemms/bench.json; a dry run writes a temp file): schema
"megafuse.bench_fp32_gemms/1", documented in docs/tools.md. `--dry-run` runs the error part on the
CPU at the given preset's widths (the tensor-core variants emulated by the same roundings; no times).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys

import torch

from megafuse.model import resolve_config
from megafuse.model.quant import fake_quant_index_mxfp4
from megafuse.model.transformer import head_logits
from megafuse.tools.bench_common import default_out, open_log, require_cuda, time_graph_us
from megafuse.tools.common import positive_ints
from megafuse.tools.output import environment, write_json

SCHEMA = "megafuse.bench_fp32_gemms/1"
VARIANTS = ("fp32", "tf32", "bf16x3", "bf16", "bf16_w3")
WITHIN_RELEASE = 2.0  # an alternative within 2x fp32's error sums the same products in another order


@contextlib.contextmanager
def tf32(enabled: bool):
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def split_bf16(x: torch.Tensor, parts: int = 2) -> tuple[torch.Tensor, ...]:
    """x ~ the sum of `parts` bf16 tensors, each the bf16 rounding of what the previous leave (8
    significant bits each: three parts hold an fp32 value's 24, up to underflow)."""
    out, rest = [], x
    for _ in range(parts):
        out.append(rest.to(torch.bfloat16))
        rest = rest - out[-1].float()
    return tuple(out)


def operands(name: str, cfg, T: int, context: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(a [M, K], b [N, K]) fp32, formed as the model forms them (module docstring)."""
    if name == "compressor":
        u = torch.randn(T, cfg.dim, generator=g).to(torch.bfloat16).float()
        w = (torch.rand(2 * cfg.head_dim, cfg.dim, generator=g) * 2 - 1) * cfg.dim ** -0.5
        return u, w
    ratio = max(cfg.compress_ratios)
    q = torch.randn(T * cfg.index_heads, cfg.index_head_dim, generator=g)
    k = torch.randn(max(context // ratio, 1), cfg.index_head_dim, generator=g)
    if cfg.quant == "ref":
        q, k = fake_quant_index_mxfp4(q), fake_quant_index_mxfp4(k)
    return q, k


def variant_fn(variant: str, a: torch.Tensor, b: torch.Tensor, b_is_weight: bool):
    """A call computing a @ b^T the variant's way (fp32 out). The weight's casts happen here, once."""
    if variant in ("fp32", "tf32"):
        def call():
            with tf32(variant == "tf32"):
                return a @ b.t()
        return call
    if variant == "bf16":
        b16 = b.to(torch.bfloat16) if b_is_weight else None
        return lambda: head_logits(a.to(torch.bfloat16), b16 if b16 is not None else b.to(torch.bfloat16))
    if variant == "bf16_w3":
        a16, b_parts = a.to(torch.bfloat16), split_bf16(b, 3)
        return lambda: sum(head_logits(a16, part) for part in b_parts)
    b_parts = split_bf16(b) if b_is_weight else None

    def call():
        a_hi, a_lo = split_bf16(a)
        b_hi, b_lo = b_parts if b_parts is not None else split_bf16(b)
        return head_logits(a_hi, b_hi) + head_logits(a_hi, b_lo) + head_logits(a_lo, b_hi)
    return call


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got.double() - exact).norm() / exact.norm()).item()


def measure(name: str, cfg, T: int, context: int, device, timed: bool) -> dict:
    g = torch.Generator().manual_seed(T)
    a, b = (t.to(device) for t in operands(name, cfg, T, context, g))
    exact = a.double() @ b.double().t()
    bf16_values = all(torch.equal(t, t.to(torch.bfloat16).float()) for t in (a, b))
    row = {"M": a.shape[0], "N": b.shape[0], "K": a.shape[1], "exact_in_bf16": bf16_values, "variants": {}}
    for variant in VARIANTS:
        if variant == "tf32" and device.type != "cuda":
            continue  # the CPU has no TF32: its fp32 call would be measured twice
        if variant == "bf16_w3" and not torch.equal(a, a.to(torch.bfloat16).float()):
            continue  # its products are exact only for bf16 values of a
        fn = variant_fn(variant, a, b, b_is_weight=name == "compressor")
        row["variants"][variant] = {"rel_error": relative_error(fn(), exact),
                                    "us": time_graph_us(fn) if timed else None}
    fp32_error = row["variants"]["fp32"]["rel_error"]
    for v in row["variants"].values():
        v["within_release"] = v["rel_error"] <= WITHIN_RELEASE * max(fp32_error, torch.finfo(torch.float32).tiny)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="flash-lite", help="preset or config JSON (default flash-lite)")
    ap.add_argument("--context", type=int, default=27648, help="tokens of context the indexer scores (default 27648)")
    ap.add_argument("--tokens", type=positive_ints, default=(1, 32, 1024), help="rows T (default 1,32,1024)")
    ap.add_argument("--out", help="results JSON (default results/fp32_gemms/bench.json)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, errors only, no times")
    args = ap.parse_args(argv)
    require_cuda(ap, args.dry_run)
    if args.context < 1:
        ap.error(f"--context must be >= 1, got {args.context}")
    cfg = resolve_config(args.config)
    if max(cfg.compress_ratios) < 1:
        ap.error(f"{cfg.name} has no compressed layers, so neither the compressor nor the indexer runs")
    out = args.out or default_out("fp32_gemms", args.dry_run)
    log = open_log(out)
    device = torch.device("cpu" if args.dry_run else "cuda")
    result = {"schema": SCHEMA, "config": cfg.name, "quant": cfg.quant, "context": args.context,
              "tokens": list(args.tokens), "dry_run": args.dry_run, "within_release_factor": WITHIN_RELEASE,
              "command": " ".join(sys.argv), "date": datetime.date.today().isoformat(),
              "environment": environment(), "gemms": {}}
    for name in ("compressor", "indexer"):
        for T in args.tokens:
            row = measure(name, cfg, T, args.context, device, timed=not args.dry_run)
            result["gemms"][f"{name}_T{T}"] = row
            log(f"{name} T={T} [{row['M']}x{row['K']}] x [{row['N']}x{row['K']}]^T, operands exact in bf16: "
                f"{row['exact_in_bf16']}: " + "; ".join(
                    f"{v} err {r['rel_error']:.2e}{'' if r['within_release'] else ' (beyond fp32)'}"
                    + (f" {r['us']:.1f} us" if r["us"] is not None else "") for v, r in row["variants"].items()))
    write_json(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
