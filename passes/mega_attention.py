"""MegaAttention: sparse attention with a sink + inverse RoPE (+ the cast) -> one generated Triton kernel.

Pattern (post-grad ATen graph, anchored at the P V `aten.bmm`), each query row with its own key rows:

    q   = cat(x[..., :-rd], RoPE(x[..., -rd:]))    optional: q's RoPE by the output's own angles, rounded to x's dtype
    s   = (q . k_j) * scale          bmm of q [.., R, H, Dh] and the keys [.., R, J, Dh], times (or over) a constant
    s   = where(~valid, -inf, s)      valid [.., R, J] bool, broadcast over the heads (or where(valid, s, -inf),
                                      s + where(valid, 0, -inf), s + a float mask built of 0 and -inf only;
                                      the fill may be any value below -1e30)
    m   = maximum(amax(s, -1), sink)  sink: one value per head; or m = amax(s, -1): m cancels below
    p   = exp(s - m) / (sum(exp(s - m), -1) + exp(sink - m))     or softmax(cat([s, sink], -1))[..., :-1]
    o   = p @ keys                    the values are the keys (K = V)
    o   = cat(o[..., :-rd], RoPE^-1(o[..., -rd:]))   pairs (2i, 2i + 1) rotated by -angle_i, in fp32
    out = o.to(dtype)                 optional
    out = MXFP8(out)                  optional (quant="ref"): blocks of 32 through e4m3 under a ue8m0 scale

Views, permutes and converts sit between the pieces (the einsums decompose into bmm); the pass
follows them and checks, through `graph.source_dims`, that each operand reaches its bmm with its
dims in the order the maths needs (rows as the batch, heads as M, keys as N, Dh contracted).

Replacement: `out = megafuse::mega_attention(q, keys, valid, sink, angles, scale, out_dtype, mxfp8, q_rope)`
on the tensors the chain starts from (one leading shape of rows for all of them), whose reference
is `lowering.mega_attention.reference` (the model's own functions); Inductor lowers it to the kernel
`lowering.mega_attention` generates; `mxfp8` is True where quant="ref"'s MXFP8 rounding follows
(`model.quant.fake_quant_mxfp8` on the output in WO-A's group layout: its blocks of 32 lie within a
head). The quantiser's scale rule is checked by running the graph's own scale ops on probe values
(`_computes`), so a rule that differs anywhere (another floor, rounding the exponent down) stays
unfused with the reason. Where q is that RoPE of x by the angles of the inverse RoPE and private
to the chain, the op takes x and `q_rope=True` (its kernel rotates q in its prologue); otherwise q's
RoPE stays outside and the spec's `left_unfused` says why. The row gathers and the byte decodes
before the chain stay unfused.

The softmax, the mask and the scale read the same in both layouts (`_front`); where the sink runs
along the scores' dim -3 of four, the layout is the dense one (HF transformers' DeepseekV4, or an
attention written that way: [batch, heads, queries, keys], one key head for all the queries, a
rotate-half inverse RoPE), the same chain, the same op; its section below says how it is read.

Not this pattern (near misses, rejected with the reason): a softmax without the sink in its
denominator (a plain softmax, or the sink in the max only), a softmax over another dim than the
keys, a sink that is not one value per head, masked values other than -inf, values other than the
keys, RoPE rotating other dims than the tail, no inverse RoPE, an MXFP8 rounding with another scale
rule, intermediates used outside the chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from . import ops
from .base import Candidate, FusionPass, NoMatch
from .graph import FLOATS, aten, call, dims, dtype, is_convert, is_last_dim, is_op, keeps_leading, moves, per_row, scalar, \
    sole_user, source_groups, strip, under_slices, unpadded, val, walk, zero_or_below
from .registry import register


def _named_order(path: list[fx.Node], names: str, want: str, what: str, *, inverse: bool = False) -> None:
    """The top of `path` holds its source's dims named `names` in the order `want`, unit dims left
    out on both sides. The first name, 'r', stands for all the source's leading dims (the rows,
    merged into one dim or not); the others name its last dims. `inverse`: the source's dims as the
    path's top names them (the output's path, from the P V bmm up to the output)."""
    source = dims(path[0] if inverse else path[-1])
    lead = len(source) - (len(names) - 1)
    if lead < 0:
        raise NoMatch(f"{what} has dims {source}; expected [rows.., {', '.join(names[1:])}]")
    name_of = {d: "r" if d < lead else names[1 + d - lead] for d in range(len(source))}
    rows = tuple(d for d in range(lead) if source[d] != 1)
    groups = source_groups(path, inverse=inverse)
    if groups is None:
        raise NoMatch(f"{what} is reshaped across its dims on the way to the attention")
    got, row_run = "", ()  # consecutive dims holding only rows, together all of them in order: "r"
    for group in groups + [None]:
        if group is not None and {name_of[d] for d in group} == {"r"}:
            row_run += group
            continue
        if row_run:
            got += "r" if row_run == rows else "(" + "r" * len(row_run) + ")"
            row_run = ()
        if group is not None:
            got += name_of[group[0]] if len(group) == 1 else "(" + "".join(name_of[d] for d in group) + ")"
    present = {name_of[d] for d in range(len(source)) if source[d] != 1}
    expected = "".join(n for n in want if n in present)
    if got != expected:
        raise NoMatch(f"{what} reaches the attention with its dims as {got!r}, not {expected!r} "
                      f"({dict(r='rows', h='heads', j='keys', d='head_dim')})")


def _cut(path: list[fx.Node], rows: list, tail: list, what: str, broadcast: bool = False) -> list[fx.Node]:
    """`path` ([top, ..., source]) up to its node nearest the source shaped rows + tail: the input
    the op takes (one leading shape of rows for all its inputs; a [None] on the way may add the
    leading 1 the output has). With `broadcast`, a leading dim may be 1 where the rows' is not (the
    op broadcasts it), if no node on the way has the rows' very shape."""
    for fits in (lambda d: d == rows + tail,
                 lambda d: broadcast and len(d) == len(rows + tail) and d[len(rows):] == tail
                 and all(a in (1, r) for a, r in zip(d, rows))):
        for i in range(len(path) - 1, -1, -1):
            if fits(dims(path[i])):
                return path[:i + 1]
    raise NoMatch(f"{what} is never shaped {rows + tail} (the output's rows) on its way to the attention")


# amax values the MXFP8 scale rule is checked on: zero, around the floor, powers of two and their
# neighbours, e4m3's range, huge and infinite values, and random ones
_AMAX_PROBES = torch.cat((torch.tensor([0.0, 1e-6, 9.99e-5, 1e-4, 1.0001e-4, 0.5, 1.0, 1.5, 2.0, 3.0, 447.9, 448.0,
                                        448.1, 896.0, 1e4, 2.0 ** 100, 3e38, float("inf")]),
                          torch.rand(64, generator=torch.Generator().manual_seed(0)) * 1e3))[:, None]


def _computes(start: fx.Node, end: fx.Node, reference, probes: torch.Tensor) -> bool:
    """Whether `end` is a function of `start` alone (constants aside) through call_function nodes,
    and computes `reference` on `probes` exactly: the graph's own ops run on them."""
    needed = set(_between(start, end))
    if any(node.op != "call_function" for node in needed):
        return False
    graph = fx.Graph()
    env = {start: graph.placeholder("x")}
    for node in start.graph.nodes:  # in graph order: inputs before users
        if node in needed:
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(env[end])
    with unset_fake_temporarily():  # the passes run under the compile's fake mode; the probes are real
        try:
            got = fx.GraphModule({}, graph)(probes)
        except Exception:  # an op that does not run eagerly on the probes: not the rule
            return False
        return isinstance(got, torch.Tensor) and torch.equal(got, reference(probes))


def _between(start: fx.Node, end: fx.Node) -> list[fx.Node]:
    """`end` and the nodes it is computed from, down to `start` (excluded) or to the graph's inputs."""
    found, stack = {}, [end]
    while stack:
        node = stack.pop()
        if node is not start and node not in found:
            found[node] = None
            if node.op == "call_function":
                stack.extend(node.all_input_nodes)
    return list(found)


def _mxfp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The MXFP8 scale rule the kernel's epilogue applies: 2^ceil(log2(max(amax, floor) / 448))."""
    from megafuse.model import quant
    return quant._ue8m0_scale(amax.clamp(min=quant._FP8_AMAX_FLOOR) / quant.E4M3_MAX)


def _clamped(node: fx.Node, bound: float) -> fx.Node | None:
    """x of clamp(x, -bound, bound) (one clamp, or clamp_min and clamp_max in either order), else None."""
    if is_op(node, aten.clamp) and tuple(node.args[1:3]) == (-bound, bound):
        return node.args[0]
    limits = {aten.clamp_min: -bound, aten.clamp_max: bound}
    seen = []
    while len(seen) < 2 and any(is_op(node, op) for op in limits) and node.target.overloadpacket not in seen:
        op = node.target.overloadpacket
        if node.args[1] != limits[op]:
            return None
        seen.append(op)
        node = node.args[0]
    return node if len(seen) == 2 else None


def _mxfp8_tail(final: fx.Node, head_dim: int) -> tuple[fx.Node, list[fx.Node], fx.Node] | None:
    """(the tail's last node, its nodes, the reshape back to the output's shape) if `final`
    [rows.., H, Dh] goes through quant="ref"'s MXFP8 rounding (model.quant.fake_quant_mxfp8, blocks of 32 along the
    flattened heads x head_dim) back to its dtype; None if it does not start one. NoMatch if it
    starts one that rounds otherwise."""
    path = [final]
    while len(path[-1].users) == 1:
        user = next(iter(path[-1].users))
        if not (is_op(user, aten.view, aten.reshape, aten._unsafe_view) and moves(user)
                or is_convert(user) and dtype(user) in FLOATS):
            break
        path.append(user)
    blocks = path[-1]
    users = list(blocks.users)
    absolute = next((u for u in users if is_op(u, aten.abs)), None)
    if len(users) != 2 or absolute is None or dims(blocks)[-1:] != [32] or len(absolute.users) != 1:
        return None
    amax = sole_user(absolute)
    if not is_op(amax, aten.amax) or list(amax.args[1]) not in ([-1], [len(dims(blocks)) - 1]):
        return None
    divided = next(u for u in users if u is not absolute)
    if not is_op(divided, aten.div) or divided.args[0] is not blocks:
        raise NoMatch("the output's blocks of 32 are not divided by their scale")
    if head_dim % 32 or dtype(blocks) != torch.float32:
        raise NoMatch(f"MXFP8 blocks of 32 over head_dim {head_dim} in {dtype(blocks)}: the epilogue rounds "
                      "fp32 blocks within a head")
    scale = divided.args[1]
    if not _computes(amax, scale, _mxfp8_scale, _AMAX_PROBES):
        raise NoMatch("the MXFP8 scale is not 2^ceil(log2(max(amax, 1e-4) / 448)) of each block's amax")
    clamp = sole_user(divided)
    if clamp is None:
        raise NoMatch("the scaled blocks are used more than once")
    top = clamp
    while len(top.users) == 1 and is_op(next(iter(top.users)), aten.clamp, aten.clamp_min, aten.clamp_max):
        top = next(iter(top.users))
    fp8 = sole_user(top)
    if _clamped(top, 448.0) is not divided or not (is_convert(fp8) and dtype(fp8) == torch.float8_e4m3fn):
        raise NoMatch("the scaled blocks are not clamped to +-448 and rounded to e4m3")
    widened = sole_user(fp8)
    product = sole_user(widened) if widened is not None and is_convert(widened) else None
    if not is_op(product, aten.mul) or widened not in product.args or walk(_other(product, widened))[-1] is not scale:
        raise NoMatch("the e4m3 values are not multiplied back by their scale")
    reshape = sole_user(product)
    if not (is_op(reshape, aten.view, aten.reshape, aten._unsafe_view) and moves(reshape)):
        raise NoMatch("the rounded blocks are not reshaped back")
    end = sole_user(reshape) if dtype(reshape) != dtype(final) else reshape
    if end is None or dtype(end) != dtype(final) or end is not reshape and not is_convert(end):
        raise NoMatch(f"the rounded output does not return to {dtype(final)}")
    clamps = [clamp] + ([top] if top is not clamp else [])
    nodes = [*path[1:], absolute, amax, *_between(amax, scale), divided, *clamps, fp8, widened,
             *walk(_other(product, widened))[:-1], product, reshape] + ([end] if end is not reshape else [])
    return end, nodes, reshape


_BEFORE_THE_SCORES = "the row gathers and byte decodes before the scores"


def _candidate(gemm: fx.Node, chain: list[fx.Node], final: fx.Node, spec, inputs: dict,
               left_unfused: tuple[str, ...] = (), **fields) -> Candidate:
    """The match, once every intermediate of the chain is known to be private to it."""
    inside = set(chain) | {final}
    nodes = [n for n in gemm.graph.nodes if n in inside]
    for node in nodes:
        if node is not final and not all(user in inside for user in node.users):
            raise NoMatch(f"intermediate {node.name} is also used outside the attention chain")
    return Candidate(gemm, nodes, spec, inputs=inputs, left_unfused=[*left_unfused, _BEFORE_THE_SCORES], **fields)


def _q_rope(q: fx.Node, head_dim: int, rope_dim: int, angles: fx.Node, rows: list) -> tuple[fx.Node, list[fx.Node]]:
    """(q before its RoPE, the RoPE's nodes) where q is `apply_rope` of it by the very angles the
    output is rotated back by (the op takes them once); NoMatch(why the q RoPE stays unfused)."""
    kept = q.args[0][0] if is_op(q, aten.cat) and len(q.args[0]) == 2 else None
    if kept is None or _slice_range(kept, head_dim) is None:
        raise NoMatch("q is not a kept part and a rotated tail joined (no RoPE of q in the graph)")
    x = kept.args[0]
    joined, q_angles, rd, nodes = _rope(x, head_dim, inverse=False)
    if joined is not q or dims(x) != dims(q):
        raise NoMatch("q is joined from another RoPE than the one of the tensor it slices")
    if rd != rope_dim:
        raise NoMatch(f"q's RoPE rotates {rd} dims, not the output's {rope_dim}")
    if _cut(walk(q_angles), rows, [rd // 2], "q's angles", broadcast=True)[-1] is not angles:
        raise NoMatch("q is rotated by other angles than the output is rotated back by")
    return x, nodes


def _viewed_fake(t, views: list):
    for op, args in views:
        t = op(t, *args)
    return t


def _viewed(graph: fx.Graph, node: fx.Node, views: list) -> fx.Node:
    """`node` through `views` ([(op, its other args)]: views, and the mask's negation), each a new
    node after the last."""
    for op, args in views:
        node = call(graph, op, (node, *args), op(val(node), *args))
    return node


def _gemm(out: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """(a, b, the GEMM's nodes) of out = a @ b: a bmm, or an mm (on GPUs Inductor turns a bmm of
    batch one into one), looking through the zero padding and the output slices of Inductor's
    shape padding (GPUs). None if `out` is no GEMM."""
    gemm, slices = under_slices(out)
    if not is_op(gemm, aten.bmm, aten.mm):
        return None
    a, b = (unpadded(x) for x in gemm.args[:2])
    if dims(out) != dims(gemm)[:-2] + [dims(a)[-2], dims(b)[-1]]:
        raise NoMatch("a GEMM's output is cut to other sizes than its unpadded operands'")
    return a, b, [gemm, *slices, *(x for x in gemm.args[:2] if x not in (a, b))]


def _other(node: fx.Node, one: fx.Node):
    a, b = node.args[:2]
    return b if a is one else a if b is one else None


def _forward_moves(node: fx.Node) -> list[fx.Node]:
    """[node, ...]: up through sole users that only move values."""
    path = [node]
    while len(path[-1].users) == 1 and moves(next(iter(path[-1].users))):
        path.append(next(iter(path[-1].users)))
    return path


def _slice_range(node: fx.Node, size: int) -> tuple[int, int] | None:
    """[start, end) of a last-dim slice with step 1, normalised to 0..size; None if it is not one."""
    if not is_op(node, aten.slice) or not is_last_dim(node.args[1] if len(node.args) > 1 else 0, node.args[0]):
        return None
    start, end = (node.args[2] if len(node.args) > 2 else 0), (node.args[3] if len(node.args) > 3 else size)
    if (node.args[4] if len(node.args) > 4 else 1) != 1 or not isinstance(start, int) or not isinstance(end, int):
        return None
    norm = lambda i: max(0, min(size, i + size if i < 0 else i))  # noqa: E731
    return norm(start), norm(end)


def _rope(o: fx.Node, head_dim: int, inverse: bool = True) -> tuple[fx.Node, fx.Node, int, list[fx.Node]]:
    """(the joined result, the angles' node, rope_dim, the nodes) of the RoPE on o's tail
    (`model.rope.apply_rope`): by -angle (`inverse`, the output; sin negated) or by +angle (q)."""
    what = "the attention output" if inverse else "q"
    slices = {n: _slice_range(n, head_dim) for n in o.users}
    if len(slices) != 2 or None in slices.values():
        raise NoMatch(f"{what} is not split into a kept part and a rotated part (no {'inverse ' * inverse}RoPE)")
    kept, rotated = sorted(slices, key=lambda n: slices[n])
    if slices[kept][0] != 0 or slices[kept][1] != slices[rotated][0] or slices[rotated][1] != head_dim:
        raise NoMatch(f"{what} is split into {sorted(slices.values())}: not [0, h) kept and [h, head_dim) rotated")
    rd = head_dim - slices[rotated][0]
    pairs = next(iter(rotated.users)) if len(rotated.users) == 1 else None
    if pairs is not None and is_convert(pairs) and len(pairs.users) == 1:
        pairs = next(iter(pairs.users))
    if not is_op(pairs, aten.view, aten.reshape, aten._unsafe_view) or dims(pairs)[-2:] != [rd // 2, 2]:
        raise NoMatch(f"the rotated part [{head_dim - rd}, {head_dim}) is not taken as {rd // 2} pairs")
    picks = {n.args[2]: n for n in pairs.users if is_op(n, aten.select) and is_last_dim(n.args[1], pairs)}
    if set(picks) != {0, 1} or len(pairs.users) != 2:
        raise NoMatch("the pairs are not read as their even and odd elements")
    even, odd = picks[0], picks[1]
    products = {}
    for x in (even, odd):
        for mul in x.users:
            other = _other(mul, x) if is_op(mul, aten.mul) else None
            is_sine = is_op(other, aten.sin) or is_op(other, aten.neg) and is_op(other.args[0], aten.sin)
            if other is None or not (is_op(other, aten.cos) or is_sine):
                raise NoMatch(f"{x.name} is not multiplied by the angles' cos or sin")
            products[(x is odd, "cos" if is_op(other, aten.cos) else "sin")] = (mul, other)
    if len(products) != 4:
        raise NoMatch("the pairs are not rotated (each element times cos and times sin)")
    cos, sin = products[(False, "cos")][1], products[(False, "sin")][1]
    angles, negated = cos.args[0], is_op(sin, aten.neg)
    sin_of = sin.args[0] if negated else sin
    if sin_of.args[0] is not angles or products[(True, "cos")][1] is not cos or products[(True, "sin")][1] is not sin:
        raise NoMatch("the rotation's cos and sin are not of one angle tensor")
    # f the sine factor (sin or -sin): (x cos - y f, x f + y cos) rotates by the angle of f,
    # (x cos + y f, y cos - x f) by minus it; the model's inverse is the first with f = -sin
    (x_cos, _), (x_f, _), (y_cos, _), (y_f, _) = (products[k] for k in ((False, "cos"), (False, "sin"), (True, "cos"),
                                                                         (True, "sin")))
    new_even, new_odd = sole_user(x_cos), sole_user(y_cos)
    forward_form = is_op(new_even, aten.sub) and new_even.args[:2] == (x_cos, y_f) and is_op(new_odd, aten.add) \
        and set(new_odd.args[:2]) == {x_f, y_cos}
    backward_form = is_op(new_even, aten.add) and set(new_even.args[:2]) == {x_cos, y_f} \
        and is_op(new_odd, aten.sub) and new_odd.args[:2] == (y_cos, x_f)
    if not (forward_form or backward_form):
        raise NoMatch("the pairs are not rotated as (x cos - y f, x f + y cos) or (x cos + y f, y cos - x f), "
                      "f the sine factor")
    if (forward_form == negated) != inverse:  # by -angle exactly where the form and f's sign differ
        raise NoMatch(f"{what} is rotated by {'+' if inverse else '-'}angle: not the {'inverse' * inverse or 'forward'} "
                      "RoPE")
    ups = [next(iter(x.users)) if len(x.users) == 1 else None for x in (new_even, new_odd)]
    cat = next(iter(ups[0].users)) if ups[0] is not None and len(ups[0].users) == 1 else None
    if not (is_op(cat, aten.cat) and list(cat.args[0]) == ups and all(is_op(u, aten.unsqueeze) for u in ups)):
        raise NoMatch("the rotated pairs are not put back in their (even, odd) order")
    back = _forward_moves(cat)
    top = back[-1]
    if len(top.users) == 1 and is_convert(next(iter(top.users))):
        back.append(next(iter(top.users)))
    joined = next(iter(back[-1].users)) if len(back[-1].users) == 1 else None
    if not (is_op(joined, aten.cat) and list(joined.args[0]) == [kept, back[-1]]
            and is_last_dim(joined.args[1] if len(joined.args) > 1 else 0, joined)):
        raise NoMatch("the kept part and the rotated tail are not joined back as [kept, rotated]")
    if inverse and (dtype(back[-1]) != torch.float32 or dtype(kept) != torch.float32):
        raise NoMatch("the inverse RoPE is rounded before the join: not where the kernel rounds")
    if not inverse and not dtype(back[-1]) == dtype(kept) == dtype(o):
        raise NoMatch(f"q's rotated tail is joined as {dtype(back[-1])}, not in q's {dtype(o)} (where the kernel rounds it)")
    nodes = [*slices, pairs, even, odd, *(m for m, _ in products.values()), cos, sin, *([sin.args[0]] if negated else []),
             new_even, new_odd, *ups, *back, joined]
    if pairs.args[0] is not rotated:
        nodes.append(pairs.args[0])
    return joined, angles, rd, nodes


# ---- what both layouts share: the softmax with the sink, the mask, the scale ---------------------
# The softmax with the sink over the keys (the last dim), in either spelling:
#
#     p = e^(s - m) / (sum_j e^(s_j - m) + e^(sink - m))    m = max(max_j s_j, sink), or m = max_j s_j
#     p = softmax(cat([s, sink], -1))[..., :-1]              the sink as the softmax's last column
#
# m cancels between the numerator and the denominator, so both forms of the max are one function.
# The kernel keeps the first (its running max starts at the sink): a row without a valid key then
# gets that function's value, 0, where the plain max computes e^(-inf - -inf) = NaN.
#
# The scores are masked as where(~valid, fill, s) (masked_fill), where(valid, s, fill) or
# s + where(valid, 0, fill), fill -inf or below -1e30, or s + a float mask the graph builds of 0
# and such fills only (a compressed layer's block bias joined to the window's mask: the op takes
# mask == 0), and scaled by a constant (s * c or s / c).

_FILL_BELOW = -1e30  # a mask value that removes a key: e^(fill - m) is 0 in fp32, as in the kernel
_NEGATE = [(aten.bitwise_not.default, ())]


@dataclass
class _Front:
    """What both layouts share, read from P V's GEMM down to the GEMM of the scores."""
    pv: fx.Node  # P V's output, past the slices that cut shape padding off it
    p: fx.Node  # P V's operands
    v: fx.Node
    qk: tuple  # (q's operand, the keys' operand, the nodes) of the scores' GEMM
    s_path: list[fx.Node]  # the scaled scores' input down to that GEMM
    scores: fx.Node  # the masked scores the softmax reads
    valid: fx.Node  # the mask
    to_bool: list  # the views that make the op's bool mask of `valid` (_mask)
    sink: fx.Node  # one value per head [H]
    heads_at: int  # the scores' dim the sink runs along, counted from the end
    scale: float
    nodes: list[fx.Node]


def _fill_value(x) -> float | None:
    return scalar(x) if scalar(x) is not None else x.args[1] if is_op(x, aten.full) else None


def _removes(x) -> bool:
    return _fill_value(x) is not None and _fill_value(x) <= _FILL_BELOW


def _under_broadcasts(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(the path from `node` down to its first broadcasting expand (the expand last), the path from
    that expand's input down to the source); without a broadcast: (walk(node), [])."""
    above = walk(node)
    if not is_op(above[-1], aten.expand):
        return above, []
    return above, walk(above[-1].args[0])


def _front(gemm: fx.Node) -> _Front:
    """The shared pieces of the attention whose P V `gemm` computes; NoMatch(why) where it is none."""
    pv = gemm
    while sole_user(pv) is not None and keeps_leading(sole_user(pv)):
        pv = sole_user(pv)
    p, v, pv_nodes = _gemm(pv)
    p_path = walk(p)
    scores, sink_b, softmax_nodes = _sink_softmax(p_path[-1])
    scores, widened = strip(scores, layout=False)  # masked in 16 bits, the softmax in fp32
    sink, heads_at = _sink_source(sink_b)
    scaled, valid, to_bool = _mask(scores)
    c = scalar(scaled.args[1]) if is_op(scaled, aten.mul, aten.div) else None
    if not c:
        raise NoMatch("the scores are not scaled by a constant")
    s_path = walk(scaled.args[0])
    qk = _gemm(s_path[-1])
    if qk is None:
        raise NoMatch("the scores are not a GEMM of q and the keys")
    nodes = [*pv_nodes, *p_path[:-1], *softmax_nodes, *widened, scores, scaled, *s_path, *qk[2]]
    return _Front(pv, p, v, qk, s_path, scores, valid, to_bool, sink, heads_at,
                  c if is_op(scaled, aten.mul) else 1 / c, nodes)


def _sink_softmax(p_top: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]]:
    """(the masked scores s, the sink as it meets them, the nodes) of P, the softmax with the sink
    in either spelling and with either max (the section's comment)."""
    if is_op(p_top, aten.slice):
        return _sink_column_softmax(p_top)
    exp_s, denom = p_top.args[:2] if is_op(p_top, aten.div) else (None, None)
    if not (is_op(exp_s, aten.exp) and is_op(exp_s.args[0], aten.sub)):
        raise NoMatch("not P V of a softmax", candidate=False)
    s, m = exp_s.args[0].args[:2]
    if not is_op(denom, aten.add):
        raise NoMatch("the softmax's denominator has no sink term (sum + e^(sink - max))")
    # the sum of e^(s - m), or Inductor's online softmax (GPUs): max and sum of s in one pass
    sums = {x: per_row(x, exp_s, ("sum",)) or per_row(x, s, ("online sum",)) for x in denom.args[:2]}
    total = next((x for x, found in sums.items() if found), None)
    if total is None:
        raise NoMatch("the softmax's sum is not over the keys (the last dim)")
    sink_exp = _other(denom, total)
    shifted = sink_exp.args[0] if is_op(sink_exp, aten.exp) else None
    if not (is_op(shifted, aten.sub) and shifted.args[1] is m):
        raise NoMatch("the softmax's denominator adds something else than e^(sink - max)")
    sink = shifted.args[0]
    online = per_row(total, exp_s, ("sum",)) is None
    found = per_row(m, s, ("online max",) if online else ("amax", "max"))  # m = max_j s_j
    if found is None and not online and is_op(m, aten.maximum, aten.clamp_min):  # m = max(max_j s_j, sink)
        in_max = next((x for x in m.args[:2] if walk(x)[-1] is walk(sink)[-1]), None)
        found = per_row(_other(m, in_max), s, ("amax", "max")) if in_max is not None else None
        found = found and [m, *found]
    if found is None:
        raise NoMatch("the softmax's max is not over the keys (the last dim): neither max_j s_j nor "
                      "max(max_j s_j, sink)")
    return s, sink, [p_top, exp_s, exp_s.args[0], denom, *sums[total], sink_exp, shifted, *found]


def _sink_column_softmax(p_top: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]]:
    """(scores, the sink column, the nodes) of p_top = softmax(cat([scores, sink], -1))[..., :-1]."""
    div, narrowed = strip(p_top.args[0], layout=False)  # softmax(.., dtype=bf16) rounds p after the division
    exp_x, total = div.args[:2] if is_op(div, aten.div) else (None, None)
    if not (is_op(exp_x, aten.exp) and is_op(exp_x.args[0], aten.sub)):
        raise NoMatch("not P V of a softmax", candidate=False)
    width = dims(div)[-1]
    if _slice_range(p_top, width) != (0, width - 1):
        raise NoMatch("the softmax's columns are cut otherwise than dropping the last (the sink's)")
    x, shift = exp_x.args[0].args[:2]
    nodes = [p_top, *narrowed, div, exp_x, exp_x.args[0]]
    # the max and the sum, or Inductor's online softmax (GPUs) that takes both from x in one pass
    for found in (per_row(shift, x, ("amax", "max", "online max")),
                  per_row(total, exp_x, ("sum",)) or per_row(total, x, ("online sum",))):
        if found is None:
            raise NoMatch("the softmax with the sink column does not reduce over the last dim")
        nodes += found
    x, widened = strip(x, layout=False)  # softmax(.., dtype=torch.float32) of 16-bit scores
    pre = per_row(x.args[1], x.args[0], ("amax", "max")) if is_op(x, aten.sub) else None
    if pre is not None:  # HF subtracts the row max once more before the softmax (in the scores' dtype)
        nodes += [x, *pre]
        x, more = strip(x.args[0], layout=False)
        widened += more
    if not (is_op(x, aten.cat) and len(x.args[0]) == 2 and is_last_dim(x.args[1] if len(x.args) > 1 else 0, x)):
        raise NoMatch("the softmax's input is not the scores with one sink column appended")
    scores, sink = x.args[0]
    if dims(sink)[-1] != 1:
        raise NoMatch(f"the column appended to the scores is {dims(sink)[-1]} wide, not one sink value")
    return scores, sink, nodes + widened + [x]


def _sink_source(sink_b: fx.Node) -> tuple[fx.Node, int]:
    """(the sink [H], the scores' dim its heads run along, counted from the end; -2 for one head)
    of `sink_b`, one value per head shaped to broadcast against the scores ([1, .., H, 1], [H, 1],
    ..), maybe expanded over the rows (a sink column). Its views stay outside the chain (dead once
    fused)."""
    above, below = _under_broadcasts(sink_b)
    path = below or above
    sink, sizes = path[-1], dims(path[0])
    heads = dims(sink)
    if len(heads) != 1 or sizes[-1:] != [1] or source_groups(path) != ([(0,)] if heads[0] != 1 else []):
        raise NoMatch(f"the sink {heads} is not one value per head broadcast against the scores")
    return sink, sizes.index(heads[0]) - len(sizes) if heads[0] != 1 else -2


def _mask(scores: fx.Node) -> tuple[fx.Node, fx.Node, list]:
    """(the scaled scores, the mask, the views that make the op's bool mask of it: [], its negation
    where True drops a key, or `== 0` of an additive mask) of the masked scores (the section's
    comment). The mask's own nodes stay outside the chain: layers may share them."""
    pairs = [scores.args[:2], scores.args[1::-1]] if is_op(scores, aten.add) else [(None, scores)]
    for scaled, where in pairs:
        if not (is_op(where, aten.where) and dtype(where.args[0]) == torch.bool):
            continue
        cond, a, b = where.args[:3]
        fill, kept, drops = (a, b, True) if _removes(a) else (b, a, False)
        if scaled is not None and not (_removes(fill) and _fill_value(kept) == 0):
            raise NoMatch(f"the additive mask is where(mask, {_fill_value(a)}, {_fill_value(b)}), "
                          "not where(valid, 0, -inf)")
        if not _removes(fill):
            value = _fill_value(a) if _fill_value(a) is not None else _fill_value(b)
            raise NoMatch(f"the masked scores are set to {value} where a key is dropped: not -inf (or below -1e30)")
        valid = cond.args[0] if drops and is_op(cond, aten.bitwise_not, aten.logical_not) else cond
        return (kept if scaled is None else scaled), valid, _NEGATE if drops and valid is cond else []
    for scaled, mask in pairs if is_op(scores, aten.add) else ():
        if zero_or_below(mask, _FILL_BELOW):  # e.g. a causal mask joined with a compressed layer's block bias
            return scaled, mask, [(aten.eq.Scalar, (0,))]
    raise NoMatch("the scores are not masked: neither where(~valid, -inf, s), where(valid, s, -inf) "
                  "nor s + a mask of 0 and -inf")


# ---- the dense layout: [batch, heads, queries, keys], one key head for every query ---------------
# HF transformers' DeepseekV4 attention (`eager_attention_forward`, `apply_rotary_pos_emb`), or one
# written the same way:
#
#     s   = (q @ k^T) * scale       q [B, H, T, D]; k [B, S, D] or [B, 1, S, D]: broadcast over the
#                                   heads (HF's repeat_kv, matmul's broadcast), or the heads and the
#                                   queries one GEMM dim (an einsum); V = K
#     o   = p @ k                   p the softmax with the sink of the masked s (above)
#     o   = cat(o[..., :-rd], r * cos2 + rotate_half(r) * -sin2)    r = o[..., -rd:]; cos2 and sin2 each
#           angle's cos and sin twice (repeat_interleave), rotate_half(r) = (-r_odd, r_even) interleaved
#
# Both GEMMs are checked by naming every operand's dims by the letters of its source's (`_names`):
# q "bhtd", the keys "bjd", the scores and P "bhtj", the output "bhtd". The op reads the tensors in
# its per-row layout through views only (no sizes, so symbolic shapes stay symbolic):
# q.transpose(1, 2), the keys as [B, 1, S, D] (broadcast over the queries), the mask as
# [B or 1, T, S], the angles [B or 1, T, rd / 2]; its output, transposed back, replaces the join.

_KEYS = {3: "bjd", 4: "bxjd"}  # the keys [B, S, D] or [B, 1, S, D]: x, the one key head
_LAYOUT = {"bhtd": "[batch, heads, queries, head_dim]", "bjd": "[batch, keys, head_dim]",
           "bxjd": "[batch, 1, keys, head_dim]"}


def _spell(path: list[fx.Node], letters, what: str, inverse: bool = False) -> list[str]:
    """The names of the dims of `path`'s top ([top, ..., source]), each the letters of the source
    dims it holds in row-major order ('' for a dim of 1), from the source's `letters`; `inverse`:
    the source's dims, named from the top's letters."""
    groups = source_groups(path, inverse=inverse)
    if groups is None:
        raise NoMatch(f"{what} is reshaped across its dims on the way to the attention")
    held = iter(groups)
    return ["".join(letters[d] for d in next(held)) if size != 1 else "" for size in dims(path[-1 if inverse else 0])]


def _names(top: fx.Node, letters: dict, what: str) -> tuple[fx.Node, list[str], list[fx.Node]]:
    """(the source under `top`, the names of top's dims as `_spell` gives them, the nodes between),
    '*' for a dim that a broadcasting expand made (the same values all along it); the source's
    letters by its rank (`letters`)."""
    above, below = _under_broadcasts(top)
    source = (below or above)[-1]
    if len(dims(source)) not in letters:
        raise NoMatch(f"{what} {dims(source)} are not {' or '.join(map(_LAYOUT.get, letters.values()))}")
    names = letters[len(dims(source))]
    if below:  # the expand's output named: its input's names, '*' where it broadcasts
        inner, out = _spell(below, names, what), dims(above[-1])
        lead = len(out) - len(inner)
        names = [inner[d - lead] if d >= lead and inner[d - lead] else "*" if size != 1 else ""
                 for d, size in enumerate(out)]
    return source, _spell(above, names, what), (above + below)[:-1]


def _contracts(a: list[str], b: list[str], out: list[str], k: str, what: str) -> None:
    """In the dims' names: a [batch, M, k] @ b [batch, k, N] = out [batch, M, N] (an mm: no batch),
    b's batch broadcast ('*') where a's holds anything."""
    a, b, out = ([""] * (3 - len(x)) + x for x in (a, b, out))
    batch = len(a[0]) == len(b[0]) and all(y in ("*", x) for x, y in zip(a[0], b[0]))
    if not (batch and a[2] == b[1] == k and out == [a[0], a[1], b[2]]):
        raise NoMatch(f"{what} do not meet in their GEMM as [batch, heads, queries, keys] needs "
                      f"({a} @ {b} = {out})")


def _expect(path: list[fx.Node], groups: list[tuple[int, ...]], what: str) -> None:
    """The top of `path` holds its source's dims as `groups` (source_groups' form; the source's
    unit dims left out of both)."""
    sizes = dims(path[-1])
    want = [g for g in (tuple(d for d in group if sizes[d] != 1) for group in groups) if g]
    if source_groups(path) != want:
        raise NoMatch(f"{what} does not reach the attention in the [batch, heads, queries, keys] layout")


def _repeated_half(node: fx.Node, rd: int, what: str) -> tuple[fx.Node, list[fx.Node]]:
    """(c, the nodes) of node = c [.., T, rd / 2] with each value repeated twice along the last dim
    (unsqueeze(-1), expand to 2, merge) and a heads dim of 1 put in front of the queries."""
    above = walk(node)
    pairs = above[-1]
    if not (is_op(pairs, aten.expand) and dims(pairs)[-2:] == [rd // 2, 2] and dims(pairs.args[0])[-1:] == [1]):
        raise NoMatch(f"{what} is not each angle's value repeated for both elements of its pair")
    lead = len(dims(pairs)) - 2
    _expect(above, [*[(d,) for d in range(lead)], (lead, lead + 1)], what)
    below = walk(pairs.args[0])
    below = below[: next((i + 1 for i, n in enumerate(below) if len(n.users) > 1), len(below))]  # q's RoPE may share it
    if dims(below[-1]) != dims(pairs)[:-1] or len(dims(node)) != lead + 2 or dims(node)[-3] != 1:
        raise NoMatch(f"{what} is not laid out [.., 1 (heads), queries, {rd}]")
    return below[-1], above[:-1] + [pairs] + below[:-1]


def _trig_of(node: fx.Node, fn) -> fx.Node | None:
    """x of node = fn(x) or fn(x) * 1 (HF's attention scaling, 1 for V4's rope), maybe cast (HF
    rounds cos and sin to a 16-bit model's dtype; the kernel keeps them fp32)."""
    if is_convert(node):
        node = node.args[0]
    if is_op(node, aten.mul) and scalar(node.args[1]) == 1.0:
        node = node.args[0]
    return node.args[0] if is_op(node, fn) else None


def _rotate_half_inverse(o: fx.Node, head_dim: int) -> tuple[fx.Node, fx.Node, int, list[fx.Node]]:
    """(the join, the angles, rope_dim, the nodes) of o's tail rotated back the rotate-half way."""
    slices = {n: _slice_range(n, head_dim) for n in o.users}
    if len(slices) != 2 or None in slices.values():
        raise NoMatch("the attention output is not split into a kept part and a rotated part (no inverse RoPE)")
    kept, r = sorted(slices, key=lambda n: slices[n])
    rd = head_dim - slices[r][0]
    if slices[kept] != (0, head_dim - rd):
        raise NoMatch(f"the output is split into {sorted(slices.values())}: not [0, h) kept and [h, head_dim) rotated")
    steps = {(n.args[2], n.args[4]): n for n in r.users
             if is_op(n, aten.slice) and len(n.args) > 4 and is_last_dim(n.args[1], r)}
    even, odd = steps.get((0, 2)), steps.get((1, 2))
    neg = sole_user(odd) if odd is not None else None
    if even is None or not is_op(neg, aten.neg):
        raise NoMatch("the rotated part is not read as its even elements and its negated odd ones (rotate_half)")
    ups = [sole_user(neg), sole_user(even)]
    pair = sole_user(ups[0]) if all(is_op(u, aten.unsqueeze) for u in ups) else None
    if not (is_op(pair, aten.cat) and list(pair.args[0]) == ups):
        raise NoMatch("rotate_half does not interleave (-odd, even)")
    half = _forward_moves(pair)
    turned = half[-1]
    if len(turned.users) == 1 and is_convert(sole_user(turned)):
        half.append(sole_user(turned))
    third = [n for n in r.users if n not in (even, odd)]  # r (maybe widened first) times cos
    x = third[0] if len(third) == 1 and is_convert(third[0]) else r
    m_cos, m_sin = sole_user(x) if x is not r else third[0] if len(third) == 1 else None, sole_user(half[-1])
    cos2 = _other(m_cos, x) if is_op(m_cos, aten.mul) else None
    sin2 = _other(m_sin, half[-1]) if is_op(m_sin, aten.mul) else None
    if cos2 is None or sin2 is None:
        raise NoMatch("the rotated part and rotate_half of it are not each multiplied by an angle factor")
    total = sole_user(m_cos)
    if not (is_op(total, aten.add) and set(total.args[:2]) == {m_cos, m_sin}):
        raise NoMatch("the two products are not added (x cos + rotate_half(x) sin)")
    c, cos_nodes = _repeated_half(cos2, rd, "the cos factor")
    s, sin_nodes = _repeated_half(sin2, rd, "the sin factor")
    angles = _trig_of(c, aten.cos)
    if angles is None or not is_op(s, aten.neg) or _trig_of(s.args[0], aten.sin) is not angles:
        raise NoMatch("the factors are not cos and -sin of one angle tensor (the inverse rotation)")
    back = [total] + ([sole_user(total)] if len(total.users) == 1 and is_convert(sole_user(total)) else [])
    joined = sole_user(back[-1])
    if not (is_op(joined, aten.cat) and list(joined.args[0]) == [kept, back[-1]]):
        raise NoMatch("the kept part and the rotated tail are not joined back as [kept, rotated]")
    nodes = [kept, r, even, odd, neg, *ups, pair, *half, m_cos, m_sin, *back, joined, *cos_nodes, *sin_nodes, s]
    return joined, angles, rd, nodes + ([x] if x is not r else [])


def _dense_candidate(f: _Front) -> dict:
    """The dense layout's pieces (the section's comment), for MegaAttentionPass.match."""
    B, H, T, S = dims(f.scores)
    q, q_names, q_nodes = _names(f.qk[0], {4: "bhtd"}, "q")
    head_dim = dims(q)[-1]
    if dims(q) != [B, H, T, head_dim]:
        raise NoMatch(f"q {dims(q)} is not [batch, heads, queries, head_dim] = [{B}, {H}, {T}, ..]")
    keys, k_names, k_nodes = _names(f.qk[1], _KEYS, "the keys (scores)")
    if dims(keys)[0] not in (1, B) or dims(keys)[1:-2] not in ([], [1]) or dims(keys)[-2:] != [S, head_dim]:
        raise NoMatch(f"the keys {dims(keys)} are not one key head [batch, (1,) keys, head_dim] for the {H} "
                      "query heads (MQA)")
    _contracts(q_names, k_names, _spell(f.s_path, "bhtj", "the scores", inverse=True), "d", "q and the keys")
    values, v_names, v_nodes = _names(f.v, _KEYS, "the keys (values)")
    if values is not keys:
        raise NoMatch("the values are not the keys (K = V)")
    o_path = _forward_moves(f.pv)
    o = o_path[-1]
    if dims(o) != [B, H, T, head_dim]:
        raise NoMatch(f"the output {dims(o)} is not [batch, heads, queries, head_dim] where the inverse RoPE reads it")
    _contracts(_spell(walk(f.p), "bhtj", "the softmax"), v_names,
               _spell(o_path[::-1], "bhtd", "the output", inverse=True), "j", "the softmax and the keys")
    mask = dims(f.valid)
    if not 2 <= len(mask) <= 4 or ([1] * (4 - len(mask)) + mask)[:2] not in ([1, 1], [B, 1]) or mask[-2:] != [T, S]:
        raise NoMatch(f"the mask {mask} is not [batch or 1, 1, queries, keys]")
    joined, angles, rope_dim, rope_nodes = _rotate_half_inverse(o, head_dim)
    if dims(angles)[-2:] != [T, rope_dim // 2] or dims(angles)[0] not in (1, B) or len(dims(angles)) != 3:
        raise NoMatch(f"the angles {dims(angles)} are not [batch, queries, rope_dim / 2]")
    final = sole_user(joined) if sole_user(joined) is not None and is_convert(sole_user(joined)) else joined
    to_rows = [(aten.permute.default, ([0, 2, 1, 3],))]
    valid_views = {4: [(aten.select.int, (1, 0))], 3: [], 2: [(aten.unsqueeze.default, (0,))]}[len(mask)]
    return dict(chain=[*f.nodes, *q_nodes, *k_nodes, *v_nodes, *o_path[1:], *rope_nodes, final], final=final,
                q=q, keys=keys, valid=f.valid, sink=f.sink, angles=angles, head_dim=head_dim,
                views={"q": to_rows, "keys": [] if len(dims(keys)) == 4 else [(aten.unsqueeze.default, (1,))],
                       "valid": valid_views + f.to_bool, "out": to_rows})


@register
class MegaAttentionPass(FusionPass):
    name = "mega_attention"
    description = "attention: sparse attention with the sink + inverse RoPE + the cast in one kernel (MQA)"
    op = "megafuse::mega_attention"
    run_order = 30

    def anchors(self, graph: fx.Graph):
        return [n for n in graph.nodes if is_op(n, aten.bmm, aten.mm)]

    def match(self, gemm: fx.Node) -> Candidate:
        # 1. The softmax with the sink, the mask and the scale; the layout from where the sink runs.
        f = _front(gemm)
        if f.heads_at == -3 and len(dims(f.scores)) == 4:
            return self._dense(gemm, f)
        if f.heads_at != -2:
            raise NoMatch(f"the sink runs along the scores' dim {f.heads_at}: not the heads of [rows.., heads, keys] "
                          "or of [batch, heads, queries, keys]")
        heads = dims(f.sink)

        # 2. The output, in the model's layout [rows.., heads, head_dim]: the rows every input is cut to.
        o_path = _forward_moves(f.pv)
        o = o_path[-1]
        if len(dims(o)) < 3 or dims(o)[-2] != heads[0]:
            raise NoMatch(f"the output {dims(o)} is not [rows.., heads, head_dim] with the sink's {heads[0]} heads")
        _named_order(o_path[::-1], "rhd", "rhd", "the output", inverse=True)
        rows, head_dim, n_keys = dims(o)[:-2], dims(o)[-1], dims(f.scores)[-1]

        # 3. q, the keys (the values too) and the mask, each row with its own.
        q_path = _cut(walk(f.qk[0]), rows, [heads[0], head_dim], "q")
        k_path = _cut(walk(f.qk[1]), rows, [n_keys, head_dim], "the keys (scores)")
        v_path = _cut(walk(f.v), rows, [n_keys, head_dim], "the keys (values)")
        if v_path[-1] is not k_path[-1]:
            raise NoMatch("the values are not the keys (K = V)")
        valid_path = _cut(walk(f.valid), rows, [n_keys], "the mask")
        q, keys, valid = q_path[-1], k_path[-1], valid_path[-1]
        _named_order(q_path, "rhd", "rhd", "q")
        _named_order(k_path, "rjd", "rdj", "the keys (scores)")
        _named_order(v_path, "rjd", "rjd", "the keys (values)")
        _named_order(f.s_path, "rhj", "rhj", "the scores", inverse=True)
        _named_order(walk(f.p), "rhj", "rhj", "the softmax")
        _named_order(valid_path, "rj", "rj", "the mask")
        if dtype(valid) != torch.bool and not f.to_bool:
            raise NoMatch(f"the mask is {dtype(valid)}, not bool")

        # 4. The inverse RoPE, the cast and the MXFP8 rounding after it.
        joined, angles_b, rope_dim, rope_nodes = _rope(o, head_dim)
        angles = _cut(walk(angles_b), rows, [rope_dim // 2], "the angles", broadcast=True)[-1]
        if dtype(angles) != torch.float32:
            raise NoMatch(f"the angles are {dtype(angles)}: the rotation the kernel reproduces runs in fp32")
        final = joined
        if len(final.users) == 1 and is_convert(next(iter(final.users))):
            final = next(iter(final.users))
        cast, tail = final, _mxfp8_tail(final, head_dim)
        if tail is not None:
            final, tail_nodes, _ = tail

        # 5. q and the keys in one dtype; everything but the output private to the chain.
        if dtype(q) != dtype(keys):
            raise NoMatch(f"q is {dtype(q)} and the keys {dtype(keys)}: the kernel reads one dtype")
        chain = [*f.nodes, *q_path[:-1], *k_path[:-1], *v_path[:-1], *o_path[1:], *rope_nodes, cast,
                 *(tail_nodes if tail else ()), final]

        def candidate(q_in: fx.Node, q_nodes: list[fx.Node], left_unfused: tuple[str, ...]) -> Candidate:
            spec = ops.attention_spec(val(q_in), val(angles), f.scale, str(dtype(cast)).removeprefix("torch."),
                                      tail is not None, q_in is not q)
            inputs = {"q": q_in, "keys": keys, "valid": valid, "sink": f.sink, "angles": angles,
                      "views": {"valid": f.to_bool}}
            return _candidate(gemm, chain + q_nodes, final, spec, inputs, left_unfused,
                              outputs={"out": final, "shape_of": tail[2] if tail else None}, insert_before=cast)

        # 6. q's RoPE by the same angles, where it is private to the chain; else it stays unfused.
        try:
            return candidate(*_q_rope(q, head_dim, rope_dim, angles, rows), ())
        except NoMatch as e:
            return candidate(q, [], (f"the q RoPE: {e.reason}",))

    def _dense(self, gemm: fx.Node, f: _Front) -> Candidate:
        d = _dense_candidate(f)
        if dtype(d["q"]) != dtype(d["keys"]):
            raise NoMatch(f"q is {dtype(d['q'])} and the keys {dtype(d['keys'])}: the kernel reads one dtype")
        if dtype(d["angles"]) != torch.float32:
            raise NoMatch(f"the angles are {dtype(d['angles'])}: the rotation the kernel reproduces runs in fp32")
        views = d["views"]
        q_rows = _viewed_fake(val(d["q"]), views["q"])
        spec = ops.attention_spec(q_rows, val(d["angles"]), f.scale, str(dtype(d["final"])).removeprefix("torch."),
                                  False, False)
        inputs = {name: d[name] for name in ("q", "keys", "valid", "sink", "angles")}
        return _candidate(gemm, d["chain"], d["final"], spec, inputs | {"views": views},
                          ("the q RoPE: HF rotates q before its [batch, heads, queries] transpose (not matched)",),
                          outputs={"out": d["final"], "shape_of": None}, insert_before=d["final"])

    def check(self, candidate: Candidate) -> str | None:
        i, views = candidate.inputs, candidate.inputs.get("views", {})
        q, keys, valid = (_viewed_fake(val(i[name]), views.get(name, [])) for name in ("q", "keys", "valid"))
        return ops.attention_unsupported(q, keys, valid, val(i["sink"]).float(), val(i["angles"]),
                                         *ops.attention_scalars(candidate.spec))

    def rewrite(self, graph: fx.Graph, candidate: Candidate) -> fx.Node:
        i, out = candidate.inputs, candidate.outputs["out"]
        with graph.inserting_before(candidate.insert_before):
            sink = i["sink"]
            if dtype(sink) != torch.float32:
                sink = call(graph, torch.ops.prims.convert_element_type.default, (sink, torch.float32),
                            val(sink).float())
            views = i.get("views", {})
            q, keys, valid = (_viewed(graph, i[name], views.get(name, [])) for name in ("q", "keys", "valid"))
            args = (q, keys, valid, sink, i["angles"], *ops.attention_scalars(candidate.spec))
            fused = call(graph, torch.ops.megafuse.mega_attention.default, args,
                         ops.attention_fake(*(val(a) for a in args)))
            fused.meta["stack_trace"] = candidate.anchor.meta.get("stack_trace")
            result = _viewed(graph, fused, views.get("out", []))
        shape_of = candidate.outputs["shape_of"]
        if shape_of is not None:  # the MXFP8 tail's shape: its sizes are defined before its last node
            with graph.inserting_before(out):
                result = call(graph, torch.ops.aten.reshape.default, (fused, shape_of.args[1]), val(out))
        out.replace_all_uses_with(result)
        return fused

