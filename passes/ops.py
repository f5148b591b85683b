"""The project's canonical ops: what a pass rewrites a matched chain into.

Each fusion has two ops with one signature:

    megafuse::<name>          canonical, functional; its eager implementation is the torch reference.
                              Passes emit it, the report and the inspector see it.
    megafuse::<name>_kernel   launches the Triton kernel generated for the call's FusionSpec (real
                              Triton on CUDA, the interpreter on CPU).

An Inductor lowering binds the first to the second, so a compiled graph runs the generated kernel
while the post-grad graph (and anything that runs it eagerly) keeps the reference semantics.
"""

from __future__ import annotations

import functools

import torch
from torch._inductor.lowering import fallback_handler, register_lowering

from megafuse.lowering import mega_attention as attention_kernels
from megafuse.lowering import mega_gate as gate_kernels
from megafuse.lowering import mega_indexer as indexer_kernels
from megafuse.lowering import mega_mhc as mhc_kernels
from megafuse.lowering import mega_moe as moe_kernels


# The kernel ops run once per layer and step in compiled code, so they are registered with the
# dispatcher directly: a custom_op's Python wrappers (autograd, alias checks) cost more than the
# launch itself (tens of microseconds a call), and nothing differentiates or aliases through them.
_library = torch.library.Library("megafuse", "FRAGMENT")


def _kernel_op(fn, fake) -> None:
    """Register `fn` as megafuse::<its name> for every backend, with `fake` for tracing; the
    schema is inferred from its annotations, like the canonical op's."""
    _library.define(fn.__name__ + torch.library.infer_schema(fn, mutates_args=()))
    _library.impl(fn.__name__, fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"megafuse::{fn.__name__}", fake, lib=_library)


# The op's arguments after (u, weight, bias): the GateSpec fields the tensors do not carry, in order.
GATE_SCALARS = ("score_func", "k", "renorm", "renorm_eps", "scale", "precision", "logits_dtype", "score_dtype",
                "choice_dtype")


def gate_spec(u: torch.Tensor, weight: torch.Tensor, bias, *scalars) -> "gate_kernels.GateSpec":
    """The GateSpec of an op call: shapes and input dtypes from the tensors, the rest from `scalars`
    (GATE_SCALARS order)."""
    return _gate_spec(weight.shape[0], weight.shape[1], u.dtype, weight.dtype, None if bias is None else bias.dtype,
                      scalars)


@functools.cache  # one spec per site, asked for on every call of the op
def _gate_spec(n_experts, hidden, input_dtype, weight_dtype, bias_dtype, scalars) -> "gate_kernels.GateSpec":
    return gate_kernels.GateSpec(
        n_experts=n_experts, hidden=hidden, has_bias=bias_dtype is not None, input_dtype=_dtype_name(input_dtype),
        weight_dtype=_dtype_name(weight_dtype), bias_dtype=_dtype_name(bias_dtype or torch.float32),
        **dict(zip(GATE_SCALARS, scalars, strict=True)))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gate_scalars(spec: "gate_kernels.GateSpec") -> tuple:
    """The op arguments after (u, weight, bias) that bind `spec` (the inverse of gate_spec)."""
    return tuple(getattr(spec, name) for name in GATE_SCALARS)


def _run_gate(impl, u, weight, bias, scalars):
    """u [..., D] and bias (any shape of E values) flattened for the launcher; (weights, ids) [..., k]."""
    spec = gate_spec(u, weight, bias, *scalars)
    flat_bias = None if bias is None else _flat(bias, 0)
    weights, ids = impl(_flat(u, 1), weight, flat_bias, spec)
    if u.dim() == 2:
        return weights, ids
    return weights.reshape(*u.shape[:-1], spec.k), ids.reshape(*u.shape[:-1], spec.k)


def gate_unsupported(u, weight, bias, *scalars) -> str | None:
    """Why the kernel launch would refuse these inputs (fake tensors will do), or None."""
    try:
        spec = gate_spec(u, weight, bias, *scalars)
        flat_bias = None if bias is None else bias.reshape(-1)
        gate_kernels.validate(u.reshape(-1, u.shape[-1]), weight, flat_bias, spec)
    except ValueError as e:
        return str(e)
    return None


@torch.library.custom_op("megafuse::mega_gate", mutates_args=())
def mega_gate(u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, score_func: str, k: int,
              renorm: bool, renorm_eps: float, scale: float, precision: str, logits_dtype: str, score_dtype: str,
              choice_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate GEMM + scoring + (bias) + top-k + gather + (renormalise) + (scale): the torch reference.
    u [..., D] -> (weights fp32, ids int64) [..., k]."""
    return _run_gate(gate_kernels.reference, u, weight, bias, (score_func, k, renorm, renorm_eps, scale, precision,
                                                               logits_dtype, score_dtype, choice_dtype))


def mega_gate_kernel(u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, score_func: str, k: int,
                     renorm: bool, renorm_eps: float, scale: float, precision: str, logits_dtype: str,
                     score_dtype: str, choice_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _run_gate(gate_kernels.mega_gate, u, weight, bias, (score_func, k, renorm, renorm_eps, scale, precision,
                                                               logits_dtype, score_dtype, choice_dtype))


def gate_fake(u, weight, bias, score_func, k, *_):
    return (u.new_empty(*u.shape[:-1], k, dtype=torch.float32), u.new_empty(*u.shape[:-1], k, dtype=torch.int64))


mega_gate.register_fake(gate_fake)
_kernel_op(mega_gate_kernel, gate_fake)


def _bind(canonical, kernel) -> None:
    """Lower `canonical` to a fallback call of `kernel` (same signature) in Inductor's output code."""
    handler = fallback_handler(kernel, add_to_fallback_set=False)
    register_lowering(canonical, type_promotion_kind=None)(lambda *args, **kwargs: handler(*args, **kwargs))


_bind(torch.ops.megafuse.mega_gate.default, torch.ops.megafuse.mega_gate_kernel.default)


# ---- megafuse::mega_mhc ---------------------------------------------------------------------------
# Outputs are always five tensors (custom ops return a fixed structure): the new stream X', the
# normalised sublayer input u, and the next site's pre / post / comb. Outputs a form does not
# produce (X' without a post, coefficients without a head) are empty tensors that nothing reads.

# megafuse::mega_mhc's scalar arguments (after the nine tensors), named as MhcSpec's fields
MHC_SCALARS = ("sinkhorn_iters", "hc_eps", "stat_eps", "norm_eps", "has_post", "has_coefficients", "pre",
               "norm_rounding")


def mhc_scalars(spec: "mhc_kernels.MhcSpec") -> tuple:
    """The op arguments after the nine tensors that bind `spec` (the inverse of mhc_spec)."""
    return tuple(getattr(spec, name) for name in MHC_SCALARS)


def mhc_spec(streams, sinkhorn_iters, hc_eps, stat_eps, norm_eps, has_post, has_coefficients, pre_mode,
             norm_rounding):
    """The MhcSpec of an op call: n, D and the stream dtype from the streams, the rest from the
    scalars (MHC_SCALARS order)."""
    return _mhc_spec(streams.shape[-2], streams.shape[-1], streams.dtype, sinkhorn_iters, hc_eps, stat_eps, norm_eps,
                     has_post, has_coefficients, pre_mode, norm_rounding)


@functools.cache  # one spec per site, asked for on every call of the op
def _mhc_spec(n, dim, stream_dtype, sinkhorn_iters, hc_eps, stat_eps, norm_eps, has_post, has_coefficients, pre_mode,
              norm_rounding):
    return mhc_kernels.MhcSpec(
        n=n, dim=dim, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, stat_eps=stat_eps, norm_eps=norm_eps,
        has_post=has_post, has_coefficients=has_coefficients, pre=pre_mode, stream_dtype=_dtype_name(stream_dtype),
        norm_rounding=norm_rounding)


def _flat(t, keep):
    """t with its leading dimensions flattened into one and the last `keep` kept (t itself where
    it already has that form: a reshape costs a dispatch per call)."""
    if t is None or t.dim() == keep + 1:
        return t
    return t.reshape(-1, *t.shape[t.dim() - keep:])


def _run_mhc(impl, streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, sinkhorn_iters, hc_eps,
             stat_eps, norm_eps, has_post, has_coefficients, pre_mode, norm_rounding, **kwargs):
    """Flatten the leading dims to tokens, run `impl`, restore them; empty tensors for absent outputs."""
    lead, n, dim = streams.shape[:-2], streams.shape[-2], streams.shape[-1]
    spec = mhc_spec(streams, sinkhorn_iters, hc_eps, stat_eps, norm_eps, has_post, has_coefficients, pre_mode,
                    norm_rounding)
    out = impl(_flat(streams, 2), _flat(y, 1), _flat(post, 1), _flat(comb, 2), _flat(carried_pre, 1),
               fn, base, scale, norm_weight, spec, **kwargs)
    shapes = ((n, dim), (dim,), (n,), (n,), (n, n))
    # a distinct empty tensor per absent output: custom-op returns may not alias each other
    return tuple(streams.new_empty(0) if t is None else t if len(lead) == 1 else t.reshape(*lead, *shape)
                 for t, shape in zip(out, shapes))


def mhc_unsupported(streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, sinkhorn_iters, hc_eps,
                    stat_eps, norm_eps, has_post, has_coefficients, pre_mode, norm_rounding,
                    fn_pieces=None) -> str | None:
    """Why the kernel launch would refuse these inputs (fake tensors will do), or None."""
    spec = mhc_spec(streams, sinkhorn_iters, hc_eps, stat_eps, norm_eps, has_post, has_coefficients, pre_mode,
                    norm_rounding)
    try:
        mhc_kernels.validate(_flat(streams, 2), _flat(y, 1), _flat(post, 1), _flat(comb, 2), _flat(carried_pre, 1),
                             fn, base, scale, norm_weight, spec)
    except ValueError as e:
        return str(e)
    return None


@torch.library.custom_op("megafuse::mega_mhc", mutates_args=())
def mega_mhc(streams: torch.Tensor, y: torch.Tensor | None, post: torch.Tensor | None, comb: torch.Tensor | None,
             carried_pre: torch.Tensor | None, fn: torch.Tensor | None, base: torch.Tensor | None,
             scale: torch.Tensor | None, norm_weight: torch.Tensor, sinkhorn_iters: int, hc_eps: float,
             stat_eps: float, norm_eps: float, has_post: bool, has_coefficients: bool, pre_mode: str,
             norm_rounding: str, fn_pieces: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
    """mHC seam (post + coefficients + pre + RMSNorm): the torch reference. fn_pieces: fn's bf16
    pieces (lowering.mega_mhc.split_fn), which the kernel loads instead of splitting fn, where the
    pass made them from a frozen fn; the reference reads fn."""
    return _run_mhc(mhc_kernels.reference, streams, y, post, comb, carried_pre, fn, base, scale, norm_weight,
                    sinkhorn_iters, hc_eps, stat_eps, norm_eps, has_post, has_coefficients, pre_mode, norm_rounding)


def mega_mhc_kernel(streams: torch.Tensor, y: torch.Tensor | None, post: torch.Tensor | None,
                    comb: torch.Tensor | None, carried_pre: torch.Tensor | None, fn: torch.Tensor | None,
                    base: torch.Tensor | None, scale: torch.Tensor | None, norm_weight: torch.Tensor,
                    sinkhorn_iters: int, hc_eps: float, stat_eps: float, norm_eps: float, has_post: bool,
                    has_coefficients: bool, pre_mode: str, norm_rounding: str, fn_pieces: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _run_mhc(mhc_kernels.mega_mhc, streams, y, post, comb, carried_pre, fn, base, scale, norm_weight,
                    sinkhorn_iters, hc_eps, stat_eps, norm_eps, has_post, has_coefficients, pre_mode, norm_rounding,
                    fn_pieces=fn_pieces)


def mhc_fake(streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, sinkhorn_iters, hc_eps, stat_eps,
             norm_eps, has_post, has_coefficients, pre_mode, norm_rounding, fn_pieces=None):
    lead, n, dim = streams.shape[:-2], streams.shape[-2], streams.shape[-1]
    f32 = dict(dtype=torch.float32)
    return (streams.new_empty(*lead, n, dim) if has_post else streams.new_empty(0),
            streams.new_empty(*lead, dim),
            streams.new_empty(*lead, n, **f32) if has_coefficients else streams.new_empty(0),
            streams.new_empty(*lead, n, **f32) if has_coefficients else streams.new_empty(0),
            streams.new_empty(*lead, n, n, **f32) if has_coefficients else streams.new_empty(0))


mega_mhc.register_fake(mhc_fake)
_kernel_op(mega_mhc_kernel, mhc_fake)
_bind(torch.ops.megafuse.mega_mhc.default, torch.ops.megafuse.mega_mhc_kernel.default)


# ---- megafuse::mega_attention ---------------------------------------------------------------------
# q [..., H, Dh], keys [..., J, Dh] (K = V), valid [..., J] bool, sink [H] fp32 and angles
# [..., rope_dim / 2] fp32, one leading shape (the rows) for all -> out [..., H, Dh] in out_dtype.
# The keys, the mask and the angles may broadcast against the rows where their leading dim is 1:
# one position per token for every sequence of a batch (angles [1, T, ..] for q [B, T, ..]), one
# key set per sequence for all its queries (HF's dense layout: keys [B, 1, J, Dh]).
# The shapes bind heads, head_dim and rope_dim; the scalars the rest. With q_rope, q is the query
# before its RoPE (the op rotates its tail by the same angles the output is rotated back by).

ATTENTION_SCALARS = ("scale", "out_dtype", "mxfp8", "q_rope")


def attention_spec(q: torch.Tensor, angles: torch.Tensor, scale: float, out_dtype: str, mxfp8: bool,
                   q_rope: bool) -> "attention_kernels.AttentionSpec":
    return _attention_spec(q.shape[-2], q.shape[-1], angles.shape[-1] * 2, q.dtype, scale, out_dtype, mxfp8, q_rope)


@functools.cache  # one spec per site, asked for on every call of the op
def _attention_spec(heads, head_dim, rope_dim, key_dtype, scale, out_dtype, mxfp8,
                    q_rope) -> "attention_kernels.AttentionSpec":
    return attention_kernels.AttentionSpec(heads=heads, head_dim=head_dim, rope_dim=rope_dim, scale=scale,
                                           key_dtype=_dtype_name(key_dtype), out_dtype=out_dtype, mxfp8=mxfp8,
                                           q_rope=q_rope)


def attention_scalars(spec: "attention_kernels.AttentionSpec") -> tuple:
    return tuple(getattr(spec, name) for name in ATTENTION_SCALARS)


def _run_attention(impl, q, keys, valid, sink, angles, scalars, check_only=False):
    """The rows' leading dims flattened for the launcher (and restored on the output). Keys shared
    along a leading dim that does not flatten with the others without a copy (HF's keys, one set
    per sequence for all its queries) take one launch per index of the first leading dim."""
    spec = attention_spec(q, angles, *scalars)
    lead = q.shape[:-2]
    keys, valid, angles = (_broadcast_rows(name, t, keep, lead) for name, t, keep in
                           (("keys", keys, 2), ("valid", valid, 1), ("angles", angles, 1)))
    if len(lead) > 1 and not _flattens(keys, 2):
        per_index = [_run_attention(impl, q[i], keys[i], valid[i], sink, angles[i], scalars, check_only)
                     for i in range(1 if check_only else lead[0])]
        return None if check_only else torch.stack(per_index)
    args = (_flat(q, 2), _flat(keys, 2), _flat(valid, 1), sink, _flat(angles, 1), spec)
    if check_only:
        return attention_kernels.validate(*args)
    out = impl(*args)
    return out if q.dim() == 3 else out.reshape(q.shape)


def _broadcast_rows(name: str, t: torch.Tensor, keep: int, lead) -> torch.Tensor:
    """t [lead.., last `keep` dims], expanded where its leading dims are 1 (a view); else ValueError."""
    if t.shape[:-keep] == lead:  # the common case, without a view's dispatch per call
        return t
    if t.dim() == len(lead) + keep and all(a in (1, r) for a, r in zip(t.shape, lead)):
        return t.expand(*lead, *t.shape[len(lead):])
    raise ValueError(f"mega_attention: {name} has leading dims {list(t.shape[:-keep])}, q {list(lead)}: every "
                     "input holds one entry per row (or 1, broadcast over the rows)")


def _flattens(t: torch.Tensor, keep: int) -> bool:
    """Whether t's leading dims merge into one without a copy."""
    try:
        t.view(-1, *t.shape[t.dim() - keep:])
    except (RuntimeError, ValueError):  # fake tensors raise the latter
        return False
    return True


def attention_unsupported(q, keys, valid, sink, angles, *scalars) -> str | None:
    """Why the kernel launch would refuse these inputs (fake tensors will do), or None."""
    try:
        _run_attention(None, q, keys, valid, sink, angles, scalars, check_only=True)
    except ValueError as e:
        return str(e)
    return None


@torch.library.custom_op("megafuse::mega_attention", mutates_args=())
def mega_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                   angles: torch.Tensor, scale: float, out_dtype: str, mxfp8: bool, q_rope: bool) -> torch.Tensor:
    """(q RoPE +) sparse attention with the sink + inverse RoPE + the cast (+ MXFP8): the torch reference."""
    return _run_attention(attention_kernels.reference, q, keys, valid, sink, angles, (scale, out_dtype, mxfp8, q_rope))


def mega_attention_kernel(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                          angles: torch.Tensor, scale: float, out_dtype: str, mxfp8: bool,
                          q_rope: bool) -> torch.Tensor:
    return _run_attention(attention_kernels.mega_attention, q, keys, valid, sink, angles,
                          (scale, out_dtype, mxfp8, q_rope))


def attention_fake(q, keys, valid, sink, angles, scale, out_dtype, mxfp8, q_rope):
    return q.new_empty(q.shape, dtype=attention_kernels.DTYPES[out_dtype])


mega_attention.register_fake(attention_fake)
_kernel_op(mega_attention_kernel, attention_fake)
_bind(torch.ops.megafuse.mega_attention.default, torch.ops.megafuse.mega_attention_kernel.default)


# ---- megafuse::mega_moe ---------------------------------------------------------------------------
# u [N, D], weights [N, k] fp32, ids [N, k] int64, w13 [E, 2F, D], w2 [E, D, F] -> out [N, D] in
# out_dtype: the routed experts' sum (lowering/mega_moe.py). The shapes and dtypes of the tensors
# bind n_experts, k, D, F and the input / weight dtypes; the scalars the rest.

MOE_SCALARS = ("swiglu_limit", "mxfp8", "out_dtype", "precision", "weight_at", "weighted_dtype", "swiglu_dtype")


def moe_spec(u, ids, w13, *scalars) -> "moe_kernels.MoeSpec":
    """The MoeSpec of an op call (MOE_SCALARS order after the tensors)."""
    return _moe_spec(w13.shape[0], ids.shape[-1], w13.shape[2], w13.shape[1] // 2, w13.dtype, u.dtype, scalars)


@functools.cache  # one spec per site, asked for on every call of the op
def _moe_spec(n_experts, k, hidden, expert_dim, weight_dtype, input_dtype, scalars) -> "moe_kernels.MoeSpec":
    return moe_kernels.MoeSpec(n_experts=n_experts, k=k, hidden=hidden, expert_dim=expert_dim,
                               weight_dtype=_dtype_name(weight_dtype), input_dtype=_dtype_name(input_dtype),
                               **dict(zip(MOE_SCALARS, scalars, strict=True)))


def moe_scalars(spec: "moe_kernels.MoeSpec") -> tuple:
    """The op arguments after the five tensors that bind `spec` (the inverse of moe_spec)."""
    return tuple(getattr(spec, name) for name in MOE_SCALARS)


def moe_unsupported(u, weights, ids, w13, w2, *scalars) -> str | None:
    """Why the kernel launch would refuse these inputs (fake tensors will do), or None."""
    try:
        moe_kernels.validate(u, weights, ids, w13, w2, moe_spec(u, ids, w13, *scalars))
    except ValueError as e:
        return str(e)
    return None


@torch.library.custom_op("megafuse::mega_moe", mutates_args=())
def mega_moe(u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
             swiglu_limit: float, mxfp8: bool, out_dtype: str, precision: str, weight_at: str,
             weighted_dtype: str, swiglu_dtype: str) -> torch.Tensor:
    """Routed experts (dispatch + w13 + clamped SwiGLU + weight before or after w2 (+ MXFP8) + w2 + sum
    over k): the torch reference, the model's own `Experts` dispatch (weight before w2) or
    lowering.mega_moe's plain formula (after)."""
    spec = moe_spec(u, ids, w13, swiglu_limit, mxfp8, out_dtype, precision, weight_at, weighted_dtype, swiglu_dtype)
    return moe_kernels.reference(u, weights, ids, w13, w2, spec)


def mega_moe_kernel(u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, swiglu_limit: float, mxfp8: bool, out_dtype: str,
                    precision: str, weight_at: str, weighted_dtype: str, swiglu_dtype: str) -> torch.Tensor:
    spec = moe_spec(u, ids, w13, swiglu_limit, mxfp8, out_dtype, precision, weight_at, weighted_dtype, swiglu_dtype)
    return moe_kernels.mega_moe(u, weights, ids, w13, w2, spec)


def moe_fake(u, weights, ids, w13, w2, swiglu_limit, mxfp8, out_dtype, precision, *roundings):
    return u.new_empty(u.shape, dtype=moe_kernels.DTYPES[out_dtype])


mega_moe.register_fake(moe_fake)
_kernel_op(mega_moe_kernel, moe_fake)
_bind(torch.ops.megafuse.mega_moe.default, torch.ops.megafuse.mega_moe_kernel.default)


# ---- megafuse::mega_indexer -----------------------------------------------------------------------
# q [R, H, d], w [R, H] fp32, pool uint8 [pages, P, B], pages [R, M], positions [R], allowed bool
# [R, M P] or None -> (top-k ids [R, K] int64, the masked scores [R, M P] fp32) (lowering/mega_indexer.py).
# The tensors bind heads, head_dim, P, the query dtype and `allowed`; the scalars the rest.

INDEXER_SCALARS = ("ratio", "topk", "key_format")


def indexer_spec(q, pool, allowed, *scalars) -> "indexer_kernels.IndexerSpec":
    """The IndexerSpec of an op call (INDEXER_SCALARS order after the tensors)."""
    return _indexer_spec(q.shape[1], q.shape[2], pool.shape[1], q.dtype, allowed is not None, scalars)


@functools.cache  # one spec per site, asked for on every call of the op
def _indexer_spec(heads, head_dim, per_page, q_dtype, allowed, scalars) -> "indexer_kernels.IndexerSpec":
    return indexer_kernels.IndexerSpec(heads=heads, head_dim=head_dim, per_page=per_page, q_dtype=_dtype_name(q_dtype),
                                       allowed=allowed, **dict(zip(INDEXER_SCALARS, scalars, strict=True)))


def indexer_scalars(spec: "indexer_kernels.IndexerSpec") -> tuple:
    """The op arguments after the six tensors that bind `spec` (the inverse of indexer_spec)."""
    return tuple(getattr(spec, name) for name in INDEXER_SCALARS)


def indexer_unsupported(q, w, pool, pages, positions, allowed, *scalars) -> str | None:
    """Why the kernel launch would refuse these inputs (fake tensors will do), or None."""
    try:
        indexer_kernels.validate(q, w, pool, pages, positions, allowed, indexer_spec(q, pool, allowed, *scalars))
    except ValueError as e:
        return str(e)
    return None


@torch.library.custom_op("megafuse::mega_indexer", mutates_args=())
def mega_indexer(q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor, pages: torch.Tensor, positions: torch.Tensor,
                 allowed: torch.Tensor | None, ratio: int, topk: int, key_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Index keys from the cache bytes + logits + ReLU + head weights + visibility (+ allowed) + top-k:
    the model's own step (decode, index_scores, select_topk)."""
    spec = indexer_spec(q, pool, allowed, ratio, topk, key_format)
    return indexer_kernels.reference(q, w, pool, pages, positions, allowed, spec)


def mega_indexer_kernel(q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor, pages: torch.Tensor,
                        positions: torch.Tensor, allowed: torch.Tensor | None, ratio: int,
                        topk: int, key_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    spec = indexer_spec(q, pool, allowed, ratio, topk, key_format)
    return indexer_kernels.mega_indexer(q, w, pool, pages, positions, allowed, spec)


def indexer_fake(q, w, pool, pages, positions, allowed, ratio, topk, key_format):
    return (q.new_empty((q.shape[0], topk), dtype=torch.int64),
            q.new_empty((q.shape[0], pages.shape[1] * pool.shape[1]), dtype=torch.float32))


mega_indexer.register_fake(indexer_fake)
_kernel_op(mega_indexer_kernel, indexer_fake)
_bind(torch.ops.megafuse.mega_indexer.default, torch.ops.megafuse.mega_indexer_kernel.default)
