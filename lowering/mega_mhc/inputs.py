"""The launcher's inputs and outputs: validation against the spec, the row-major layouts the
kernel indexes, fn's bf16 pieces, and fresh or caller-given output tensors."""

from __future__ import annotations

import torch

from ..launch import empty
from .spec import DTYPES, TRACE_EVENTS, MhcSpec, slot_width, unsupported_reason
from .tuning import projects_bf16_pieces


def check_tensor(name, t, shape, dtypes, device):
    if t is None:
        raise ValueError(f"mega_mhc: {name} is required by this spec but is None")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"mega_mhc: {name} must be {list(shape)}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        names = " or ".join(dict.fromkeys(str(d).replace("torch.", "") for d in dtypes))
        raise ValueError(f"mega_mhc: {name} dtype {str(t.dtype).replace('torch.', '')} must be {names}")
    if t.device != device:
        raise ValueError(f"mega_mhc: {name} is on {t.device}, streams on {device}")


def validate(streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, spec: MhcSpec):
    """Raise ValueError naming the first input the kernel cannot take (shape, dtype, device). The
    pass runs it on a match's fake tensors, so what a launch would refuse stays unfused instead."""
    reason = unsupported_reason(spec)
    if reason:
        raise ValueError(f"mega_mhc: unsupported spec: {reason}")
    n, D = spec.n, spec.dim
    sdtype = DTYPES[spec.stream_dtype]
    if streams is None or streams.dim() != 3 or tuple(streams.shape[1:]) != (n, D):
        got = None if streams is None else list(streams.shape)
        raise ValueError(f"mega_mhc: streams must be [T, {n}, {D}], got {got}")
    if streams.dtype != sdtype:
        raise ValueError(f"mega_mhc: streams dtype {streams.dtype} does not match spec stream_dtype "
                         f"{spec.stream_dtype}")
    T, device, f32 = streams.shape[0], streams.device, (torch.float32,)
    if spec.has_post:
        # y is read once and widened to fp32, so its dtype need not be the streams' (torch 2.11 folds
        # a bf16 model's last X' round trip away, leaving fp32 streams with a bf16 y)
        check_tensor("y", y, (T, D), tuple(DTYPES.values()), device)
        check_tensor("post", post, (T, n), f32, device)
        check_tensor("comb", comb, (T, n, n), f32, device)
    if spec.pre == "carried":
        check_tensor("carried_pre", carried_pre, (T, n), f32, device)
    if spec.has_coefficients:
        check_tensor("fn", fn, ((2 + n) * n, n * D), f32, device)
        check_tensor("base", base, ((2 + n) * n,), f32, device)
        check_tensor("scale", scale, (3,), f32, device)
    check_tensor("norm_weight", norm_weight, (D,), f32, device)


def _rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """Innermost dimensions contiguous (rows may be strided, even broadcast with stride 0)."""
    if t is None:
        return None
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return t.contiguous()
        expected *= size
    return t




def split_fn(fn: torch.Tensor, spec: MhcSpec) -> torch.Tensor:
    """fn [(2+n)n, nD] fp32 -> its bf16 pieces [2, slot, nD] (hi rows, then lo rows; the rows past
    (2+n)n zero), as the kernel's _split makes them: hi = fn rounded to bf16, lo = (fn - hi) rounded,
    both to nearest even. For `mega_mhc(fn_pieces=...)` where fn is fixed (frozen weights)."""
    if not projects_bf16_pieces(spec):
        raise ValueError(f"split_fn: fn's bf16 pieces are for bf16 streams with coefficients, not the "
                         f"{spec.stream_dtype} {spec.form()} form")
    check_tensor("fn", fn, (spec.width(), spec.n * spec.dim), (torch.float32,), fn.device)
    hi = fn.to(torch.bfloat16)
    lo = (fn - hi.float()).to(torch.bfloat16)
    pieces = torch.zeros((2, slot_width(spec.n), spec.n * spec.dim), dtype=torch.bfloat16, device=fn.device)
    pieces[0, :spec.width()], pieces[1, :spec.width()] = hi, lo
    return pieces


def check_fn_pieces(fn_pieces: torch.Tensor, spec: MhcSpec, device) -> None:
    if not projects_bf16_pieces(spec):
        raise ValueError(f"mega_mhc: fn_pieces are for bf16 streams with coefficients, not the "
                         f"{spec.stream_dtype} {spec.form()} form")
    check_tensor("fn_pieces", fn_pieces, (2, slot_width(spec.n), spec.n * spec.dim), (torch.bfloat16,), device)
    if not fn_pieces.is_contiguous():
        raise ValueError("mega_mhc: fn_pieces must be contiguous (split_fn makes them so)")



def new_outputs(spec: MhcSpec, T: int, device) -> tuple:
    """Fresh (X', u, pre', post', comb'), None where the spec has no such output."""
    sdtype, f32 = DTYPES[spec.stream_dtype], torch.float32
    n, D = spec.n, spec.dim
    return (empty((T, n, D), sdtype, device) if spec.has_post else None,
            empty((T, D), sdtype, device),
            empty((T, n), f32, device) if spec.has_coefficients else None,
            empty((T, n), f32, device) if spec.has_coefficients else None,
            empty((T, n, n), f32, device) if spec.has_coefficients else None)


def row_major(streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, spec: MhcSpec) -> tuple:
    """The inputs with the layouts the kernel indexes: rows may be strided, their insides not."""
    streams = streams if streams.stride(2) == 1 else streams.contiguous()
    y, post, comb, carried_pre = (_rows(t) if used else None for t, used in (
        (y, spec.has_post), (post, spec.has_post), (comb, spec.has_post), (carried_pre, spec.pre == "carried")))
    if spec.has_coefficients:
        fn, base, scale = fn.contiguous(), base.contiguous(), scale.contiguous()
    return streams, y, post, comb, carried_pre, fn, base, scale, norm_weight.contiguous()



def check_trace(trace: torch.Tensor, plan: dict, device) -> None:
    if device.type != "cuda":
        raise ValueError("mega_mhc: trace needs a CUDA device (the interpreter has no %globaltimer)")
    want = (plan["n_jobs"], len(TRACE_EVENTS))
    if tuple(trace.shape) != want or trace.dtype != torch.int64 or trace.device != device \
            or not trace.is_contiguous():
        raise ValueError(f"mega_mhc: trace must be a contiguous int64 {list(want)} tensor on {device}, "
                         f"got {trace.dtype} {list(trace.shape)} on {trace.device}")
    trace.zero_()


def check_out(out, spec: MhcSpec, T: int, device) -> None:
    n, D = spec.n, spec.dim
    sdtype = DTYPES[spec.stream_dtype]
    want = ((T, n, D, sdtype) if spec.has_post else None, (T, D, sdtype),
            *(((T, n, torch.float32), (T, n, torch.float32), (T, n, n, torch.float32))
              if spec.has_coefficients else (None, None, None)))
    if len(out) != 5:
        raise ValueError("mega_mhc: out must hold five entries (streams, u, pre, post, comb)")
    for name, t, w in zip(("streams", "u", "pre", "post", "comb"), out, want):
        if w is None:
            if t is not None:
                raise ValueError(f"mega_mhc: out {name} must be None for this spec")
            continue
        if t is None or tuple(t.shape) != w[:-1] or t.dtype != w[-1] or t.device != device \
                or not t.is_contiguous():
            raise ValueError(f"mega_mhc: out {name} must be a contiguous {list(w[:-1])} {w[-1]} on {device}")

