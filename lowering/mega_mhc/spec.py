"""What the Mega-mHC generator specialises on: MhcSpec, the forms it covers, and the constants the
generated kernel and its launcher share."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

# Stream dtypes (X', the collapse and u are rounded to it; every statistic is fp32). fp16 streams
# take the fp32 projection (their widened X' against fp32 fn: fp16 values are not bf16's).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PRE_MODES = ("carried", "fresh")
# How u = RMSNorm(c) is rounded to the stream dtype. "once": (c * r * weight).to(dtype), the
# reference's (and HF DeepseekV4's fp32-weight norm). "twice": (c * r).to(dtype) * weight, rounded
# again: `weight * x.to(input_dtype)`, the RMSNorm of Llama-style models, whose weight has the stream
# dtype (bf16 * bf16 is exact in fp32, so rounding the fp32 product once more is what eager does).
NORM_ROUNDINGS = ("once", "twice")
# Sync words count in their low HANDOFF_SHIFT bits (so a tile has fewer stage-A jobs than 2 **
# HANDOFF_SHIFT); with Dispatch.HANDOFF a tile's ARRIVE_A word also holds one bit per rescale
# part above the count (bits up to 30 of the int32: MAX_HANDOFF_PARTS).
HANDOFF_SHIFT = 16
MAX_HANDOFF_PARTS = 31 - HANDOFF_SHIFT
# Stage A may sweep a token tile as sub-tiles (LaunchConfig.sub_tiles); the generated code names
# sub-tile s's values with SUB_SUFFIX[s] and has code for at most MAX_SUB_TILES of them.
SUB_SUFFIX = ("", "_s1")
MAX_SUB_TILES = len(SUB_SUFFIX)
# A traced launch (`mega_mhc(..., trace=...)`, CUDA only) records one int64 row per program: the
# GPU's %globaltimer (ns) at each of these events (0 where the program never reached it), then
# its job number, role and the SM it ran on (%smid: which programs shared an SM). tools/bench_mhc.py
# --trace turns them into a launch's timeline.
TRACE_TIMES = ("start", "claimed", "ready", "work", "arrived", "finished", "end")
TRACE_EVENTS = TRACE_TIMES + ("job", "role", "sm")
TRACE_ROLES = ("tiled", "stage A", "collapse", "rescale")
# A timing diagnostic (`mega_mhc(..., leave_out=...)`, tools/bench_mhc.py --leave-out): stage A with
# one of its parts compiled out, to place its time by difference (the outputs are then wrong by
# design: never for use). Part -> bit of the kernel's LEAVE_OUT constexpr.
LEAVE_OUT_PARTS = {
    "fn_loads": 1,  # fn's blocks are zeros: no fn reads (nor, without fn_pieces, its split)
    "dots": 2,  # no projection dots (and so no fn reads either): the coefficients see m = 0
    "stream_stores": 4,  # X' is computed but not stored
    "parked_store": 8,  # the collapse is not parked: the rescale reads whatever u held
}
_keys: dict = {}  # spec -> key(), memoised (the launch path asks for it on every call)


@dataclass(frozen=True)
class MhcSpec:
    """Everything the generator specialises on (what a pass binds from one matched seam).

        form                         has_post  has_coefficients  pre
        delayed seam (V4.1)          yes       yes               carried
        first seam (one-hot pre)     no        yes               carried
        Engram seam (after inject)   no        yes               carried
        final collapse + last norm   yes       no                carried
        V4 non-delayed               either    yes               fresh
    """
    n: int
    dim: int
    sinkhorn_iters: int
    hc_eps: float
    stat_eps: float
    norm_eps: float
    has_post: bool
    has_coefficients: bool
    pre: str
    stream_dtype: str
    norm_rounding: str = "once"

    def key(self) -> str:
        """Short hash of the generated source (file names, memo keys): equal keys, equal kernels."""
        key = _keys.get(self)
        if key is None:
            from .codegen import source_key
            key = _keys[self] = source_key(self)
        return key

    def width(self) -> int:
        """Rows of fn: [pre n | post n | comb n*n]."""
        return (2 + self.n) * self.n

    def describe(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(key=self.key(), form=self.form(), width=self.width(), slot=slot_width(self.n),
                 outputs=self.outputs(), unsupported=unsupported_reason(self))
        return d

    def form(self) -> str:
        if self.pre == "fresh":
            return "V4 non-delayed (fresh pre)" + ("" if self.has_post else ", no post")
        if not self.has_coefficients:
            return "final collapse" if self.has_post else "collapse + norm only"
        return "delayed seam" if self.has_post else "first / Engram seam (no post)"

    def outputs(self) -> list[str]:
        """Names of the non-None entries of mega_mhc's result tuple."""
        out = (["streams"] if self.has_post else []) + ["u"]
        return out + (["pre", "post", "comb"] if self.has_coefficients else [])


def unsupported_reason(spec: MhcSpec) -> str | None:
    """None if the generator handles `spec`, else a sentence saying why not (for the pass report)."""
    if not isinstance(spec.n, int) or spec.n not in (2, 4, 8):
        return (f"{spec.n} residual streams: the kernel holds the [n, n] Sinkhorn block and the n "
                "streams as register tiles, which needs n in 2, 4, 8")
    if not isinstance(spec.dim, int) or spec.dim < 1:
        return f"hidden size {spec.dim!r} must be a positive integer"
    if spec.stream_dtype not in DTYPES:
        return f"stream dtype {spec.stream_dtype!r} is not supported (one of {', '.join(DTYPES)})"
    if spec.pre not in PRE_MODES:
        return f"pre mode {spec.pre!r} is not one of {', '.join(PRE_MODES)}"
    if spec.norm_rounding not in NORM_ROUNDINGS:
        return f"norm rounding {spec.norm_rounding!r} is not one of {', '.join(NORM_ROUNDINGS)}"
    if spec.pre == "fresh" and not spec.has_coefficients:
        return "a fresh pre needs the coefficients of this site (has_coefficients=False)"
    if spec.has_coefficients and (not isinstance(spec.sinkhorn_iters, int) or not 1 <= spec.sinkhorn_iters <= 1000):
        return f"{spec.sinkhorn_iters!r} Sinkhorn iterations is outside 1..1000"
    for name in ("hc_eps", "stat_eps", "norm_eps"):
        value = getattr(spec, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.0):
            return f"{name} {value!r} must be a finite number >= 0"
    return None


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def slot_width(n: int) -> int:
    """A workspace partial-sums row: (2+n)n projections, sum X'^2, sum c^2; a power of two >= 16
    (it is also the N of the projection dot)."""
    return max(16, next_pow2((2 + n) * n + 2))
