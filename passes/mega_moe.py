"""Mega-MoE: the routed experts' chain -> the generated Mega-MoE kernels (lowering/mega_moe.py).

Pattern (post-grad ATen graph, anchored at the per-token `aten.sum` over the k slots), in the two
forms `model.moe.Experts` writes, with S = N * k slots of tokens u [N, D]:

    bf16 weights (`_grouped`)                        fp32 weights (`_gathered`)
    order   = sort(ids)[1]                           tokens = expand(u[:, None], [N, k, D]).reshape(S, D)
    offs    = cumsum(scatter_add(zeros(E), ids, 1))  gate_up = bmm(w13[ids], tokens[..., None])
    tokens  = u[order // k] (.to(bf16))
    gate_up = _grouped_mm(tokens, w13^T, offs).float()
    act     = silu(min(g, L)) * clamp(v, -L, L) * w[order, None]      act = (same) * w[:, None]
    act     = mxfp8(act)   (quant="ref", optional)                    act = mxfp8(act) (optional)
    down    = _grouped_mm(act.to(bf16), w2^T, offs).float()[sort(order)[1]]    down = bmm(w2[ids], act[..., None])
    out     = down.view(N, k, D).sum(1) (.to(dtype))

where [g | v] = split(gate_up, F) and ids, w are the routing's flat [S] expert ids and weights.
SiLU may be spelled x / (1 + exp(-x)) (torch's decomposition), x * sigmoid(x) or silu(x); the clamp
of v as clamp_min + clamp_max in either order, or one clamp.

Replacement: `out = megafuse::mega_moe(u, w.view(N, k), ids.view(N, k), w13, w2, limit, mxfp8,
out_dtype, precision, weight_at, weighted_dtype, swiglu_dtype)`, whose reference is the model's
own `Experts._grouped` / `_gathered` and `sum_slots` (weight before w2, fp32 SwiGLU) or
lowering.mega_moe's plain formula (the rest); Inductor lowers it to the four generated launches.

Why they are equal: both compute, for every slot, its token through its expert, weighted before
(or after) the down projection, and sum each token's k slots in slot order. The sort and its inverse only
move rows (each slot's output depends on its own row alone, so the kernel's counting sort, stable
by slot, gives the same rows), the offsets are the per-expert counts the kernel counts, and the
kernel rounds where the chain rounds (u, gate_up, act and down to bf16 in the bf16 form; MXFP8 of
act in blocks of 32 along F). The input's own MXFP8 rounding (quant="ref") stays outside the
chain: the op reads the rounded tokens, as the chain's dispatch does.

The slot weight may instead multiply the down projection's output, `slot = (down * w)[.to(...)]`
(HF's DeepseekV4 experts, grouped_mm and batched_mm, fp32 and bf16; weight_at="after", the product
rounded to the narrowest dtype among the mul and its converts: weighted_dtype), and the SwiGLU may
be computed in bf16 op by op as HF's `_apply_gate` traces on a bf16 GEMM output (each op upcast,
computed in fp32, its result rounded to bf16: swiglu_dtype="bfloat16"). The grouped GEMM may be
HF's opaque `transformers::grouped_mm_fallback` (fp32 under compile: the same grouped product).
The sum may be in bf16 (summing bf16 slots, accumulated in fp32 and rounded once: out_dtype), and
bf16 routing weights are widened to fp32 by the rewrite (exact).

Also matched (docs/mega_moe.md, docs/spellings.md): the grouped dispatch spelled HF's way (torch.sort,
histc counts, the inverse as inv[order] = arange), and the reference loop over experts
`rows, slot = torch.where(ids == e); out[rows] += (swiglu(u[rows] @ w13[e].T) * w[rows, slot, None]) @ w2[e].T`
captured with fullgraph=True, or with the weight after the expert, `out[rows] += w * expert_e(u[rows])`
(E unrolled nonzero blocks, anchored at ids == 0; k <= 2 only, as it sums a token's slots in expert order). A clamped SwiGLU alone in its graph over a graph input (the
experts' GEMMs left outside by a graph break) is reported, never silently skipped.

Not this pattern (near misses, rejected with the reason): another activation (plain silu without
the min(g, limit), gelu, ...), v not clamped to [-limit, limit], clamps at different limits, a bf16
SwiGLU rounded otherwise than `_apply_gate` or at a limit that is no bf16 value, an e4m3 rounding that is not model.quant's MXFP8, a dispatch whose sort, counts and gathers do not
all read the same expert ids, intermediates used outside the chain.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from megafuse.lowering import mega_moe as moe_kernels

from . import ops
from .base import Candidate, FusionPass, NoMatch
from .graph import aten, call, dims, dtype, is_convert, is_op, prims, rank, scalar, val
from .registry import register

_SQUEEZES = (aten.squeeze, aten.unsqueeze, aten.view, aten.reshape, aten._unsafe_view)


def _through(node, *packets, chain: list) -> fx.Node:
    """Down from `node` through ops of `packets` (recorded in `chain`) to the first other node."""
    while is_op(node, *packets):
        chain.append(node)
        node = node.args[0]
    return node


def _name(node) -> str:
    return getattr(getattr(node, "target", None), "__name__", str(getattr(node, "target", node)))


def _float32(node: fx.Node, chain: list) -> fx.Node:
    """The node under a convert to fp32 (the chain's `.float()`), recorded in `chain`."""
    if is_convert(node) and dtype(node) == torch.float32:
        chain.append(node)
        return node.args[0]
    return node


# ---- the activation --------------------------------------------------------------------------------

def _silu_input(node: fx.Node, chain: list) -> fx.Node:
    """x of silu(x): x / (1 + exp(-x)), x * sigmoid(x) or silu(x)."""
    if is_op(node, aten.silu):
        chain.append(node)
        return node.args[0]
    if is_op(node, aten.div):
        x, den = node.args
        if (is_op(den, aten.add) and scalar(den.args[1]) == 1.0 and is_op(den.args[0], aten.exp)
                and is_op(den.args[0].args[0], aten.neg) and den.args[0].args[0].args[0] is x):
            chain += [node, den, den.args[0], den.args[0].args[0]]
            return x
    if is_op(node, aten.mul):
        for x, s in (node.args, node.args[::-1]):
            if is_op(s, aten.sigmoid) and s.args[0] is x:
                chain += [node, s]
                return x
    raise NoMatch(f"the activation is not SiLU (found {_name(node)}): the kernel's SwiGLU is "
                  "silu(min(g, limit)) * clamp(v, -limit, limit)")


def _clamped(node: fx.Node, chain: list) -> tuple[fx.Node, float | None, float | None]:
    """(x, low, high) of a clamp of x: clamp_min / clamp_max in either order, or one clamp."""
    low = high = None
    while True:
        if is_op(node, aten.clamp_max) and high is None:
            high = scalar(node.args[1])
        elif is_op(node, aten.clamp_min) and low is None:
            low = scalar(node.args[1])
        elif is_op(node, aten.clamp) and low is None and high is None:
            low, high = (scalar(a) if a is not None else None for a in (node.args + (None, None))[1:3])
        else:
            return node, low, high
        chain.append(node)
        node = node.args[0]


def _converts(node: fx.Node, chain: list) -> fx.Node:
    """Down through converts (recorded in `chain`): only where they are exact (bf16 values)."""
    while is_convert(node):
        chain.append(node)
        node = node.args[0]
    return node


def _swiglu(node: fx.Node, chain: list) -> tuple[fx.Node, fx.Node, float, str]:
    """(g, v, limit, rounding) of silu(min(g, limit)) * clamp(v, -limit, limit), computed in fp32 from
    the GEMM's output (rounding "float32"), or in bf16 op by op as HF's `_apply_gate` traces on a bf16
    GEMM output (rounding "bfloat16": each op upcast, computed in fp32 and its result rounded)."""
    if is_convert(node) and dtype(node) == torch.float32 and is_op(node.args[0], aten.mul) \
            and dtype(node.args[0]) == torch.bfloat16:  # a bf16 SwiGLU widened: exact
        chain.append(node)
        node = node.args[0]
    if not is_op(node, aten.mul):
        raise NoMatch(f"the activation is not a gated product silu(g) * v (found {_name(node)})")
    narrowed = [a for a in node.args if is_convert(a) and dtype(a) != torch.float32]
    args, rounding = node.args, "float32"
    if narrowed:
        if len(narrowed) != 2 or {dtype(node), *map(dtype, narrowed)} != {torch.bfloat16}:
            raise NoMatch(f"the SwiGLU is computed in {str(dtype(narrowed[0])).removeprefix('torch.')} but not as "
                          "HF's _apply_gate traces in bf16 (silu(min(g, limit)) and clamp(v) each rounded to bf16, "
                          "then their bf16 product): another rounding the kernel does not reproduce")
        args, rounding = [a.args[0] for a in narrowed], "bfloat16"
    tried = []
    for a, b in (args, args[::-1]):
        inner = list(narrowed)
        try:
            gate = _silu_input(a, inner)
        except NoMatch as e:
            tried.append(e)
            continue
        if rounding == "bfloat16":  # min(g, L) of bf16 g and a bf16 L is a bf16 value: its converts are exact
            gate = _converts(gate, inner)
            b = _converts(b, inner)
        g, low, limit = _clamped(gate, inner)
        if limit is None or low is not None:
            raise NoMatch("silu(g) without min(g, limit): the kernel's SwiGLU clamps the gate half from above")
        v, v_low, v_high = _clamped(b, inner)
        if v_low is None or v_high is None:
            raise NoMatch("the linear half v is not clamped to [-limit, limit]: not the clamped SwiGLU")
        if not (v_high == limit and v_low == -limit):
            raise NoMatch(f"the clamps differ: min(g, {limit}) but clamp(v, {v_low}, {v_high})")
        if rounding == "bfloat16":
            g, v = _converts(g, inner), _converts(v, inner)
            if dtype(g) != torch.bfloat16 or dtype(v) != torch.bfloat16:
                raise NoMatch("the SwiGLU is computed in bf16 op by op over a GEMM output that is not bf16")
            if float(torch.tensor(limit).to(torch.bfloat16)) != limit:
                raise NoMatch(f"the SwiGLU is computed in bf16 with a limit {limit} that is no bf16 value: the "
                              "kernel's bf16 SwiGLU rounds min(g, limit) where the chain may not")
        chain += [node, *inner]
        return g, v, limit, rounding
    raise tried[0]


def _halves(g: fx.Node, v: fx.Node, chain: list) -> fx.Node:
    """gate_up of [g | v] = split(gate_up, F, -1)."""
    if not (g.target is operator.getitem and v.target is operator.getitem and g.args[0] is v.args[0]
            and (g.args[1], v.args[1]) == (0, 1)):
        raise NoMatch("g and v are not the two halves of one projection's output")
    split = g.args[0]
    if not is_op(split, aten.split, aten.split_with_sizes) or len(split.users) != 2:
        raise NoMatch("g and v are not the two halves of one projection's output")
    gate_up = split.args[0]
    if dims(g) != dims(v) or dims(gate_up)[-1] != 2 * dims(g)[-1]:
        raise NoMatch("g and v are not the two halves of one projection's output")
    chain += [g, v, split]
    return gate_up


# ---- MXFP8 (model.quant.fake_quant_mxfp8) ------------------------------------------------------------

def _mxfp8_input(node: fx.Node, chain: list) -> fx.Node | None:
    """x where `node` is fake_quant_mxfp8(x) as model.quant traces it; None where no e4m3 rounding
    is in sight; NoMatch where one is, but not MXFP8's."""
    if not is_op(node, aten.view, aten.reshape) or not is_op(node.args[0], aten.mul):
        return None
    mul = node.args[0]
    values, scale_view = mul.args
    found = []
    e4m3 = _float32(values, found)
    if not (is_convert(e4m3) and dtype(e4m3) == torch.float8_e4m3fn):
        return None
    wrong = NoMatch("the activation is rounded through e4m3, but not as model.quant's MXFP8 (a ue8m0 scale "
                    "2^ceil(log2(max(amax, 1e-4) / 448)) per 32 along F)")
    clamp, low, high = _clamped(e4m3.args[0], found)
    if (low, high) != (-448.0, 448.0) or not is_op(clamp, aten.div):
        raise wrong
    blocks, scale = clamp.args
    if not is_op(blocks, aten.view, aten.reshape) or dims(blocks)[-1] != moe_kernels.MXFP8_BLOCK:
        raise wrong
    # scale = 2^ceil(log2(r)) from r's bits, r = max(amax(|blocks|), 1e-4) / 448
    bits_up = [scale]
    s = scale
    steps = ((aten.view, None), (aten.__lshift__, 23), (aten.clamp_max, 254), (aten.add, None))
    for op, constant in steps:
        if not is_op(s, op) or (constant is not None and scalar(s.args[1]) != constant):
            raise wrong
        s = s.args[0]
        bits_up.append(s)
    add = bits_up[-2]
    exponent, mantissa_set = add.args
    if not (is_op(exponent, aten.bitwise_and) and is_op(exponent.args[0], aten.__rshift__) and is_convert(mantissa_set)
            and is_op(mantissa_set.args[0], aten.ne) and is_op(mantissa_set.args[0].args[0], aten.bitwise_and)):
        raise wrong
    r_bits = exponent.args[0].args[0]
    masks = (scalar(exponent.args[1]), scalar(exponent.args[0].args[1]), scalar(mantissa_set.args[0].args[0].args[1]),
             scalar(mantissa_set.args[0].args[1]))
    if masks != (255, 23, 0x7FFFFF, 0) or mantissa_set.args[0].args[0].args[0] is not r_bits \
            or not is_op(r_bits, aten.view):
        raise wrong
    r = r_bits.args[0]
    if not (is_op(r, aten.div) and scalar(r.args[1]) == 448.0 and is_op(r.args[0], aten.clamp_min)
            and scalar(r.args[0].args[1]) == 1e-4 and is_op(r.args[0].args[0], aten.amax)):
        raise wrong
    amax = r.args[0].args[0]
    if not (is_op(amax.args[0], aten.abs) and amax.args[0].args[0] is blocks and list(amax.args[1]) in ([-1], [2])):
        raise wrong
    scale_nodes = bits_up[:-1] + [exponent, exponent.args[0], mantissa_set, mantissa_set.args[0],
                                  mantissa_set.args[0].args[0], r_bits, r, r.args[0], amax, amax.args[0]]
    if _through(scale_view, aten.squeeze, aten.unsqueeze, chain=found) is not scale:
        raise wrong
    chain += [node, mul, e4m3, clamp, blocks, *found, *scale_nodes]
    return blocks.args[0]


# ---- the two forms ----------------------------------------------------------------------------------

def _sorted_by(index: fx.Node, what: str) -> fx.Node:
    """The tensor `index` sorts: index = sort(x)[1] (argsort)."""
    if not (index.target is operator.getitem and index.args[1] == 1 and is_op(index.args[0], aten.sort)):
        raise NoMatch(f"{what} is not an argsort")
    return index.args[0].args[0]


def _expert_counts(offs: fx.Node, chain: list) -> fx.Node:
    """ids of offs = cumsum(scatter_add(zeros(E), 0, ids, ones(S))), or of
    cumsum(histc(ids.float(), E, 0, E - 1)) over the ids or their sorted values (HF's spelling: E bins
    over [0, E - 1] put each integer id in its own bin)."""
    if is_op(offs, aten.cumsum) and is_op(offs.args[0], aten.histc):
        histc = offs.args[0]
        counted = histc.args[0]
        bins, low, high = (list(histc.args[1:]) + [100, 0, 0])[:3]
        if not (is_convert(counted) and dtype(counted) == torch.float32):
            raise NoMatch("the grouped GEMM's offsets are a histogram of something other than the expert ids")
        ids = counted.args[0]
        sorted_values = ids.target is operator.getitem and ids.args[1] == 0 and is_op(ids.args[0], aten.sort)
        n_experts = dims(offs)[0]
        if (bins, scalar(low), scalar(high)) != (n_experts, 0, n_experts - 1) or n_experts < 2:
            raise NoMatch(f"the grouped GEMM's offsets are histc(ids, {bins}, {low}, {high}): not one bin per "
                          f"expert over [0, {n_experts - 1}]")
        chain += [offs, histc, counted]
        if sorted_values:
            chain.append(ids)
            return ids.args[0].args[0]
        return ids
    if not is_op(offs, aten.cumsum) or not is_op(offs.args[0], aten.scatter_add):
        raise NoMatch("the grouped GEMM's offsets are not the cumulative per-expert counts")
    scatter = offs.args[0]
    zeros, dim, ids, ones = scatter.args
    if not (is_op(zeros, aten.full) and scalar(zeros.args[1]) == 0 and is_op(ones, aten.full)
            and scalar(ones.args[1]) == 1 and dim == 0):
        raise NoMatch("the grouped GEMM's offsets are not the cumulative per-expert counts")
    chain += [offs, scatter, zeros, ones]
    return ids


def _transposed_weight(node: fx.Node, chain: list) -> fx.Node:
    if not (is_op(node, aten.permute) and list(node.args[1]) == [0, 2, 1]):
        raise NoMatch("the grouped GEMM does not read an expert weight [E, out, in] transposed")
    chain.append(node)
    return node.args[0]


def _down_input(act_in: fx.Node, down: fx.Node, chain: list) -> fx.Node:
    """The activation the down GEMM reads: cast to the GEMM's dtype, or already in it."""
    if is_convert(act_in) and dtype(act_in) == dtype(down):
        chain.append(act_in)
        return act_in.args[0]
    if dtype(act_in) != dtype(down):
        raise NoMatch("the down projection's input is not the activation cast to the weights' dtype")
    return act_in


def _grouped(slot_out: fx.Node, k: int, chain: list, after: dict | None) -> dict:
    """The grouped form, from [down (* w)][argsort(order)] up to the dispatch."""
    if not is_op(slot_out, aten.index) or len(slot_out.args[1]) != 1:
        raise NoMatch("the grouped form's slot outputs are not restored to slot order by an index")
    inverse = slot_out.args[1][0]
    if is_op(inverse, aten.index_put):  # inv = empty(S); inv[order] = arange(S) (HF's spelling)
        target, index, values = inverse.args[:3]
        if not (len(index) == 1 and is_op(values, prims.iota) and scalar(values.kwargs.get("start", 0)) == 0
                and scalar(values.kwargs.get("step", 1)) == 1 and dims(values) == dims(inverse)
                and is_op(target, aten.empty, aten.full, aten.zeros) and not (inverse.args[3:] and inverse.args[3])):
            raise NoMatch("the slot outputs are not restored to slot order (an index_put that is not inv[order] = arange)")
        order = index[0]
        chain += [target, values]
    else:
        order = _sorted_by(inverse, "the inverse permutation")
    down = _float32(after["down"] if after else slot_out.args[0], chain)
    if not _is_grouped_gemm(down):
        raise NoMatch(f"the slot outputs are not a grouped GEMM's (found {_name(down)})")
    act_in, w2_t, offs = down.args[:3]
    chain += [slot_out, inverse, down] + ([] if is_op(inverse, aten.index_put) else [inverse.args[0]])
    ids = _expert_counts(offs, chain)
    if _sorted_by(order, "the dispatch order") is not ids:
        raise NoMatch("the dispatch sorts other ids than the expert counts count")
    chain += [order, order.args[0]]
    act, weight = _weighted(_down_input(act_in, down, chain), chain, after)
    weight = _through(weight, aten.unsqueeze, chain=chain)  # w[order].unsqueeze(-1) or w[order, None]
    if not (is_op(weight, aten.index) and len(weight.args[1]) == 1 and weight.args[1][0] is order):
        raise NoMatch("the slot weights are not taken in the dispatch's order")
    chain.append(weight)
    weights = _through(weight.args[0], aten.unsqueeze, chain=chain)
    gate_up = _float32(_halves(*_swiglu_of(act, chain), chain), chain)
    if not _is_grouped_gemm(gate_up) or gate_up.args[2] is not offs:
        raise NoMatch("the gate-up projection is not a grouped GEMM over the same expert offsets")
    tokens, w13_t = gate_up.args[:2]
    chain.append(gate_up)
    if is_convert(tokens):
        chain.append(tokens)
        tokens = tokens.args[0]
    if not (is_op(tokens, aten.index) and len(tokens.args[1]) == 1 and is_op(tokens.args[1][0], aten.div)):
        raise NoMatch("the grouped GEMM's tokens are not u[order // k]")
    rows = tokens.args[1][0]
    if rows.args[0] is not order or rows.args[1] != k or rows.kwargs.get("rounding_mode") != "floor":
        raise NoMatch("the grouped GEMM's tokens are not u[order // k]")
    chain += [tokens, rows]
    return dict(u=tokens.args[0], weights=weights, ids=ids, w13=_transposed_weight(w13_t, chain),
                w2=_transposed_weight(w2_t, chain), mxfp8=act["mxfp8"], limit=act["limit"], swiglu=act["swiglu"])


def _gathered(slot_out: fx.Node, k: int, chain: list, after: dict | None) -> dict:
    """The batched form, from squeeze(bmm(w2[ids], act[..., None])) (* w) up to the repeated tokens."""
    down = _through(_float32(after["down"] if after else slot_out, chain), aten.squeeze, chain=chain)
    w2_rows, act_col = down.args
    chain.append(down)
    ids = _gathered_weight_ids(w2_rows, chain)
    act_in = _down_input(_through(act_col, aten.unsqueeze, chain=chain), down, chain)
    act, weight = _weighted(act_in, chain, after)
    weights = _through(weight, aten.unsqueeze, chain=chain)
    gate_up = _through(_float32(_halves(*_swiglu_of(act, chain), chain), chain), aten.squeeze, chain=chain)
    if not is_op(gate_up, aten.bmm):
        raise NoMatch(f"the gate-up projection is not a batched GEMM over gathered expert weights (found {_name(gate_up)})")
    chain.append(gate_up)
    w13_rows, tokens = gate_up.args
    if _gathered_weight_ids(w13_rows, chain) is not ids:
        raise NoMatch("the two projections gather their expert weights by other ids")
    # tokens = u.float().repeat_interleave(k, 0): unsqueeze(1) + expand to [N, k, D] + reshape to [S, D]
    repeated = _through(_through(tokens, aten.unsqueeze, chain=chain), aten.reshape, aten.view, aten.clone, chain=chain)
    if not (is_op(repeated, aten.expand) and rank(repeated) == 3 and dims(repeated)[1] == k
            and is_op(repeated.args[0], aten.unsqueeze) and repeated.args[0].args[1] == 1):
        raise NoMatch("the batched GEMM's tokens are not u repeated k times (repeat_interleave)")
    chain += [repeated, repeated.args[0]]
    u = repeated.args[0].args[0]
    if is_convert(u) and dtype(u) == torch.float32:
        chain.append(u)
        u = u.args[0]
    return dict(u=u, weights=weights, ids=ids, w13=w13_rows.args[0], w2=w2_rows.args[0], mxfp8=act["mxfp8"],
                limit=act["limit"], swiglu=act["swiglu"])


def _weight_after(node: fx.Node, chain: list) -> dict | None:
    """{"down": the down GEMM's side, "weight": the slot weight factor, "dtype": what the product is
    rounded to} where `node` is [convert](down * w); None where no weight multiplies an expert GEMM's
    output. A convert after the product rounds it (bf16) or widens it (exact): the narrowest dtype
    of the two is the product's rounding."""
    found = []
    product = _through(node, prims.convert_element_type, chain=found)
    if not is_op(product, aten.mul):
        return None
    for down, weight in (product.args, product.args[::-1]):
        base = _through(down, aten.squeeze, prims.convert_element_type, chain=[])
        if isinstance(weight, fx.Node) and dims(weight)[-1:] == [1] and _is_expert_gemm(base):
            rounded = {dtype(product), *(dtype(n) for n in found)}
            if not rounded <= {torch.float32, torch.bfloat16}:
                raise NoMatch(f"the slot weight's product with the down projection is rounded to {rounded}: "
                              "the kernel rounds it to float32 or bfloat16")
            chain += [product, *found]
            return {"down": down, "weight": weight,
                    "dtype": "bfloat16" if torch.bfloat16 in rounded else "float32"}
    return None


def _is_grouped_gemm(node) -> bool:
    """aten._grouped_mm, or HF's opaque transformers::grouped_mm_fallback (the same grouped product,
    one torch.mm per expert's rows: what HF dispatches to under torch.compile for non-bf16 weights)."""
    return is_op(node, aten._grouped_mm) or (
        isinstance(node, fx.Node) and node.op == "call_function" and "transformers.grouped_mm_fallback" in str(node.target))


def _is_expert_gemm(node) -> bool:
    """bmm, _grouped_mm, or a custom grouped-GEMM op (HF's opaque transformers::grouped_mm_fallback)."""
    if is_op(node, aten.bmm, aten._grouped_mm):
        return True
    return isinstance(node, fx.Node) and node.op == "call_function" and "grouped_mm" in str(node.target)


def _gathered_weight_ids(rows: fx.Node, chain: list) -> fx.Node:
    """ids of rows = w[ids] (an expert weight gathered per slot)."""
    if not (is_op(rows, aten.index) and len(rows.args[1]) == 1 and rank(rows.args[0]) == 3):
        raise NoMatch("the batched GEMM does not read expert weights gathered by the slots' ids")
    chain.append(rows)
    return rows.args[1][0]


def _weighted(node: fx.Node, chain: list, after: dict | None = None) -> tuple[dict, fx.Node]:
    """({"node": the SwiGLU product, mxfp8, ...}, the slot weight factor) of act = [mxfp8](swiglu * w),
    or of act = [mxfp8](swiglu) where `after` (_weight_after) holds the weight found past the down GEMM."""
    inner = _mxfp8_input(node, chain)
    mxfp8 = inner is not None
    node = inner if mxfp8 else node
    if after is not None:
        return {"node": node, "mxfp8": mxfp8}, after["weight"]
    if not is_op(node, aten.mul):
        raise NoMatch(f"no slot weight multiplies the activation before the down projection (found {_name(node)})")
    for act, weight in (node.args, node.args[::-1]):
        if isinstance(weight, fx.Node) and dims(weight)[-1:] == [1] and dims(act)[-1:] != [1]:
            chain.append(node)
            return {"node": act, "mxfp8": mxfp8}, weight
    raise NoMatch("no slot weight multiplies the activation before the down projection")


def _swiglu_of(act: dict, chain: list) -> tuple[fx.Node, fx.Node]:
    g, v, act["limit"], act["swiglu"] = _swiglu(act["node"], chain)
    return g, v


# ---- the loop over experts (the reference spelling) ------------------------------------------------------

def _is_loop_anchor(node: fx.Node) -> bool:
    """`ids == 0` on int64 ids [N, k]: where a loop over the experts starts."""
    return (is_op(node, aten.eq) and isinstance(node.args[1], int) and node.args[1] == 0 and rank(node.args[0]) == 2
            and dtype(node.args[0]) == torch.int64)


def _expert_row(node: fx.Node, e: int, what: str, chain: list) -> fx.Node:
    """W of permute(select(W, 0, e), [1, 0]) (expert e's [out, in] weight, transposed for an mm)."""
    if not (is_op(node, aten.permute) and list(node.args[1]) == [1, 0] and is_op(node.args[0], aten.select)
            and node.args[0].args[1:] == (0, e) and rank(node.args[0].args[0]) == 3):
        raise NoMatch(f"expert {e}'s {what} projection does not read row {e} of one [E, out, in] weight tensor "
                      "(separate per-expert weights: the op reads them stacked)")
    chain += [node, node.args[0]]
    return node.args[0].args[0]


def _loop(first: fx.Node) -> Candidate:
    """`for e in range(E): rows, slot = torch.where(ids == e); out[rows] += expert_e(u[rows]) ...`, captured as
    E unrolled blocks (nonzero with an unbacked row count) accumulated by index_put."""
    ids = first.args[0]
    n_tokens, k = dims(ids)
    compares = {n.args[1]: n for n in ids.users if is_op(n, aten.eq) and isinstance(n.args[1], int)}
    n_experts = len(compares)
    if n_experts < 2 or sorted(compares) != list(range(n_experts)):
        raise NoMatch("ids == 0 is not the first of a loop comparing the ids with every expert 0..E-1",
                      candidate=False)
    if any(is_op(user, aten.any) for user in first.users):
        raise NoMatch("a dense loop over the experts ((ids == e).any(-1)): every expert runs on every token and is "
                      "masked, summed in expert order; the op runs each slot's expert alone and sums in slot order")
    wheres = [user for user in first.users if is_op(user, aten.nonzero)]
    if len(first.users) != 1 or not wheres:
        raise NoMatch("ids == 0 does not select expert 0's slots (torch.where)", candidate=False)
    chain, asserts, found = [], [], {}
    blocks = {}  # accumulation node -> (its input accumulation, expert)
    for e, compare in compares.items():
        where = next(iter(compare.users))
        if len(compare.users) != 1 or not is_op(where, aten.nonzero):
            raise NoMatch(f"ids == {e} does not select expert {e}'s slots by torch.where")
        unbind = [u for u in where.users if is_op(u, aten.unbind)]
        if len(unbind) != 1:
            raise NoMatch(f"expert {e}'s torch.where is not unpacked into rows and slots")
        parts = {u.args[1]: u for u in unbind[0].users if u.target is operator.getitem}
        rows, slot = parts.get(0), parts.get(1)
        chain += [compare, where, unbind[0], *parts.values()]
        for user in where.users:  # the unbacked row count's range checks
            if is_op(user, aten.sym_size):
                chain.append(user)
                for check in user.users:
                    chain.append(check)
                    asserts += [a for a in check.users if is_op(a, aten._assert_scalar)]
        accumulations = [u for u in rows.users if is_op(u, aten.index_put) and u.args[1] and u.args[1][0] is rows]
        if len(accumulations) != 1:
            raise NoMatch(f"expert {e}'s outputs are not accumulated into the output rows (out[rows] += y)")
        acc = accumulations[0]
        target, _, value = acc.args[:3]
        def reads_rows(node):
            return is_op(node, aten.index) and node.args[0] is target and node.args[1][0] is rows
        if acc.args[3:] and acc.args[3]:  # index_add_: out[rows] accumulates y
            y = value
        elif is_op(value, aten.add) and reads_rows(value.args[0]):  # out[rows] += y
            chain += [value, value.args[0]]
            y = value.args[1]
        elif is_op(value, aten.addmm) and reads_rows(value.args[0]) and not value.kwargs:  # Inductor's fold of it
            chain += [value.args[0]]
            y = value
        else:
            raise NoMatch(f"expert {e}'s output rows are overwritten, not accumulated")
        chain.append(acc)
        blocks[acc] = (target, e)
        # y = (act * w[rows, slot]) @ w2[e]^T or w[rows, slot] * (act @ w2[e]^T), act = swiglu(u[rows] @ w13[e]^T)
        after = None
        if is_op(y, aten.mul) and any(is_op(side, aten.mm) for side in y.args):
            down = next(side for side in y.args if is_op(side, aten.mm))
            after = {"down": down, "weight": y.args[1] if y.args[0] is down else y.args[0],
                     "dtype": str(dtype(y)).removeprefix("torch.")}
            chain.append(y)
            y = down
        if not is_op(y, aten.mm, aten.addmm):
            raise NoMatch(f"expert {e}'s output is not a down projection (found {_name(y)})")
        chain.append(y)
        down_in, down_w = y.args[-2:]
        w2 = _expert_row(down_w, e, "down", chain)
        act, weight = _weighted(down_in, chain, after)
        weight = _through(weight, aten.unsqueeze, chain=chain)
        if not (is_op(weight, aten.index) and [i for i in weight.args[1]] == [rows, slot]):
            raise NoMatch(f"expert {e}'s slot weights are not weights[rows, slot] of its torch.where")
        chain.append(weight)
        weights = _through(weight.args[0], aten.unsqueeze, chain=chain)
        gate_up = _halves(*_swiglu_of(act, chain), chain)
        if not is_op(gate_up, aten.mm):
            raise NoMatch(f"expert {e}'s gate-up projection is not a GEMM (found {_name(gate_up)})")
        chain.append(gate_up)
        w13 = _expert_row(gate_up.args[1], e, "gate-up", chain)
        tokens = gate_up.args[0]
        if not (is_op(tokens, aten.index) and len(tokens.args[1]) == 1 and tokens.args[1][0] is rows):
            raise NoMatch(f"expert {e}'s tokens are not u[rows] of its torch.where")
        chain.append(tokens)
        u = _float32(tokens.args[0], chain)
        this = dict(u=u, weights=weights, w13=w13, w2=w2, limit=act["limit"], mxfp8=act["mxfp8"],
                    placement=_placement(after, act))
        for name, value in this.items():
            if found.setdefault(name, value) is not value and found[name] != value:
                raise NoMatch(f"the experts of the loop read other {name} (expert {e})")
    # the accumulations chain from zeros through every expert once
    order, node = [], next(a for a in blocks if not any(u in blocks for u in a.users))
    while node in blocks:
        order.append(node)
        node = blocks[node][0]
    if len(order) != n_experts or not (is_op(node, aten.full) and scalar(node.args[1]) == 0):
        raise NoMatch("the experts' outputs are not accumulated one after another into zeros")
    chain.append(node)
    if k > 2:
        raise NoMatch(f"the loop sums each token's k = {k} slots in expert order, the op in slot order (another "
                      "rounding; equal only for k <= 2)")
    w13, w2 = found["w13"], found["w2"]
    if dims(w13)[0] != n_experts or dims(w2)[0] != n_experts or dtype(w13) != torch.float32:
        raise NoMatch(f"the loop runs {n_experts} experts over fp32 GEMMs, but the weights are "
                      f"{dtype(w13)} {dims(w13)}: the op runs every expert of the tensor in its dtype")
    final = order[0]
    if len(final.users) == 1 and is_convert(next(iter(final.users))):
        final = next(iter(final.users))
        chain.append(final)
    inside = set(chain) | set(asserts)
    nodes = [n for n in first.graph.nodes if n in inside]
    for node in nodes:
        if node is not final and not all(user in inside for user in node.users):
            raise NoMatch(f"intermediate {node.name} is also used outside the MoE chain")
    _routing_dtypes(found["weights"], ids)
    spec = ops.moe_spec(val(found["u"]), val(ids), val(w13), found["limit"], found["mxfp8"],
                        str(dtype(final)).removeprefix("torch."), "tf32x3", *found["placement"])
    return Candidate(first, nodes, spec, inputs={"u": found["u"], "weights": found["weights"], "ids": ids, "w13": w13,
                                                 "w2": w2},
                     outputs={"out": final, "asserts": asserts}, insert_before=order[0])


def _is_lone_swiglu(node: fx.Node) -> bool:
    """A clamped SwiGLU over a graph input that leaves its graph: the experts' GEMMs are in no graph."""
    if not is_op(node, aten.mul) or not any(user.op == "output" for user in node.users):
        return False
    try:
        g, v, _, _ = _swiglu(node, [])
        gate_up = _float32(_halves(g, v, []), [])
    except NoMatch:
        return False
    return gate_up.op == "placeholder"


LONE_SWIGLU = ("a clamped SwiGLU alone in its graph, over a graph input: the experts' GEMMs and the sum over "
               "their slots run outside any graph (a graph break: a loop over experts whose torch.where / "
               "nonzero has a data-dependent size breaks the graph without fullgraph=True, and Dynamo then runs "
               "the loop eagerly); nothing here to fuse")


# ---- the pass ---------------------------------------------------------------------------------------------

def _routing_dtypes(weights: fx.Node, ids: fx.Node) -> None:
    if dtype(weights) not in (torch.float32, torch.bfloat16) or dtype(ids) != torch.int64:
        raise NoMatch(f"routing weights in {dtype(weights)} and ids in {dtype(ids)}: the kernel reads float32 "
                      "weights (bf16 ones widened, exactly) and int64 ids")


def _placement(after: dict | None, found: dict) -> tuple[str, str, str]:
    """(weight_at, weighted_dtype, swiglu_dtype) of the spec."""
    return ("after", after["dtype"], found["swiglu"]) if after else ("before", "float32", found["swiglu"])


@register
class MegaMoePass(FusionPass):
    name = "mega_moe"
    description = ("MoE routed experts: counting dispatch + w13 + clamped SwiGLU + weight (+ MXFP8) + w2 + "
                   "sum over k in one generated kernel family")
    op = "megafuse::mega_moe"
    default_options = {"precision": "tf32x3"}
    option_choices = {"precision": moe_kernels.PRECISIONS}
    run_order = 40

    def anchors(self, graph: fx.Graph):
        return [n for n in graph.nodes if is_op(n, aten.sum) or _is_loop_anchor(n) or _is_lone_swiglu(n)]

    def match(self, total: fx.Node) -> Candidate:
        if is_op(total, aten.mul):
            raise NoMatch(LONE_SWIGLU)
        if _is_loop_anchor(total):
            candidate = _loop(total)
            candidate.spec = dataclasses.replace(candidate.spec, precision=self.options["precision"])
            return candidate
        # 1. The anchor: a sum over dim 1 of slot outputs viewed [N, k, D].
        slots = total.args[0]
        if list(total.args[1] if len(total.args) > 1 else []) != [1] or rank(slots) != 3 \
                or not is_op(slots, aten.view, aten.reshape):
            raise NoMatch("not a sum over the k slots of [N, k, D]", candidate=False)
        n_tokens, k, hidden = dims(slots)
        slot_out = slots.args[0]
        chain = [total, slots]

        # 2. Where the weight applies: on the down GEMM's output (HF), or before it (the model).
        grouped = is_op(slot_out, aten.index)
        after = _weight_after(slot_out.args[0] if grouped else slot_out, chain)
        # 3. Which form: the slot outputs of a grouped GEMM (restored to slot order) or of a batched one.
        down = after["down"] if after else slot_out.args[0] if grouped else slot_out
        under = _through(_float32(down, []), aten.squeeze, chain=[])
        if grouped and _is_grouped_gemm(under):
            found = _grouped(slot_out, k, chain, after)
        elif not grouped and is_op(under, aten.bmm):
            found = _gathered(slot_out, k, chain, after)
        else:
            raise NoMatch("the summed slots are not an expert GEMM's output", candidate=False)

        # 4. The inputs: tokens [N, D], flat weights and ids [S], w13 [E, 2F, D], w2 [E, D, F].
        u, weights, ids, w13, w2 = (found[name] for name in ("u", "weights", "ids", "w13", "w2"))
        S = dims(ids)
        if dims(u) != [n_tokens, hidden] or S != dims(weights) or rank(ids) != 1 or rank(w13) != 3 or rank(w2) != 3:
            raise NoMatch(f"the dispatch's tokens {dims(u)}, weights {dims(weights)} and ids {dims(ids)} do not "
                          f"make {n_tokens} tokens of {k} slots")
        _routing_dtypes(weights, ids)

        # 5. The output: the sum (accumulated in fp32, rounded to its dtype), or an fp32 sum's cast (sum_slots).
        final, out_dtype = total, dtype(total)
        if out_dtype == torch.float32 and len(total.users) == 1 and is_convert(next(iter(total.users))):
            final = next(iter(total.users))
            out_dtype = dtype(final)
            chain.append(final)

        # 6. Everything but the output must be private to the chain.
        inside = set(chain)
        nodes = [n for n in total.graph.nodes if n in inside]
        for node in nodes:
            if node is not final and not all(user in inside for user in node.users):
                raise NoMatch(f"intermediate {node.name} is also used outside the MoE chain")

        spec = ops.moe_spec(val(u), val(ids).reshape(-1, k), val(w13), found["limit"], found["mxfp8"],
                            str(out_dtype).removeprefix("torch."), self.options["precision"], *_placement(after, found))
        return Candidate(total, nodes, spec, inputs={"u": u, "weights": weights, "ids": ids, "w13": w13, "w2": w2},
                         outputs={"out": final})

    def check(self, candidate: Candidate) -> str | None:
        """The generator's support and the launcher's own input checks, on the match's fake tensors."""
        i, k = candidate.inputs, candidate.spec.k
        return ops.moe_unsupported(val(i["u"]), val(i["weights"]).reshape(-1, k).float(), val(i["ids"]).reshape(-1, k),
                                   val(i["w13"]), val(i["w2"]), *ops.moe_scalars(candidate.spec))

    def rewrite(self, graph: fx.Graph, candidate: Candidate) -> fx.Node:
        spec, inputs, out = candidate.spec, candidate.inputs, candidate.outputs["out"]
        with graph.inserting_before(candidate.insert_before or candidate.anchor):
            routing = [call(graph, aten.reshape.default, (inputs[name], [-1, spec.k]),
                            val(inputs[name]).reshape(-1, spec.k)) for name in ("weights", "ids")]
            if dtype(routing[0]) != torch.float32:  # bf16 routing weights, widened (exact)
                routing[0] = call(graph, prims.convert_element_type.default, (routing[0], torch.float32),
                                  val(routing[0]).float())
            args = (inputs["u"], *routing, inputs["w13"], inputs["w2"], *ops.moe_scalars(spec))
            fused = call(graph, torch.ops.megafuse.mega_moe.default, args,
                         ops.moe_fake(*(val(a) for a in args)))
        for node in (*routing, fused):
            node.meta["stack_trace"] = candidate.anchor.meta.get("stack_trace")
        out.replace_all_uses_with(fused)
        for check in candidate.outputs.get("asserts", ()):  # the range checks of the loop's unbacked row counts
            graph.erase_node(check)
        return fused
