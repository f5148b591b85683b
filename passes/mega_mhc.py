"""Mega-mHC: the mHC seam between two sublayers -> one generated Triton kernel.

Pattern (post-grad ATen graph), anchored at the fn projection of a site's coefficient head, or at
the mix of a post whose stream no matched head reads (the final collapse):

    X' = hc_post(y, X, post, comb)   = (post[j] y + sum_i comb[i,j] X[i]).to(stream dtype)     optional
    x  = flatten(X').float();   r = 1 / sqrt(mean(x^2) + eps)
    m  = (x @ fn^T) * r               or (x * r) @ fn^T (HF's order)
    pre  = sigmoid(m_pre  * scale0 + base_pre) + hc_eps
    post = 2 sigmoid(m_post * scale1 + base_post)
    comb = Sinkhorn(softmax(m_comb * scale2 + base_comb) + hc_eps)          exactly `iters` rounds
    c  = (sum_k p[k] X'[k]).to(stream dtype)      p: the carried pre (V4.1, delayed) or `pre` (V4)
    u  = RMSNorm(c)

Replacement: `(X', u, pre, post, comb) = megafuse::mega_mhc(X, y, post, comb, p, fn, base, scale,
norm_weight, ...)`, whose reference composes `model.mhc` and `model.layers.rms_normalize`.

Forms: the delayed seam (post + coefficients + carried pre + norm), the first seam (no post; the
carried pre is one-hot), the Engram seam (the injection sits between the previous post and the
coefficients: the post stays unfused and the report says so), the final collapse before the last
norm (post + carried pre + norm, no coefficients), and V4's non-delayed site (the collapse reads
the site's own fresh pre).

Why they are equal: the kernel computes the reference's fp32 statistics and rounds X' and c to the
stream dtype exactly where the reference does; Sinkhorn runs the same number of rounds. The
matcher checks that the chain does the same: every step of it computes in fp32 and it rounds only
X', c and u (a bf16 post, as HF's bf16 model writes it, is another function and stays unfused).

Spellings. Every product and GEMM of the seam (the post's C^T X and post * y, the fn projection,
the collapse) is read as what it does to the axes of the tensors it reads (`_contract`): each axis
of a result is a list of *atoms*, the source axes it runs over, and a GEMM or a broadcast product
pairs atoms and sums some away. So an einsum, `comb.mT @ X`, a bmm of flattened batches or a
broadcast product summed over i is accepted when it sums comb's *first* index against X's stream
index, and refused, with that reason, when it sums the second (C X). Size-1 axes carry nothing,
so T = 1 (where Inductor specialises size-1 dims and drops them in its views) reads the same. The
statistics accept rsqrt or 1 / sqrt of mean(x^2) or sum(x * x) / size (keepdim or unsqueezed), the
three parts of the mix and of base split or sliced (`graph.last_dim_parts`), softmax decomposed,
online or as exp / sum, the Sinkhorn sums keepdim or unsqueezed, every operand order.

Whole, or a reason: a head whose collapse + norm is missing is refused with the reason; a seam
whose post does not match fuses without it and says why in the spec's `left_unfused` notes; a
post + collapse whose coefficient head does not match fuses as a final collapse with a note
naming the head's reason (or is refused, with both reasons, where the collapse reads that head's
pre).

Dtypes: streams fp32, bf16 or fp16 (the spec's stream dtype; y may be any of them). The kernel
reads post, comb, the carried pre, fn, base, scale and the norm weight in fp32: where the graph
holds them in bf16 or fp16 (a model cast to bf16), the rewrite widens them first, which is exact.

Inductor's freezing (`torch._inductor.config.freezing`) makes the weights constants (get_attr
nodes) and folds whatever reads only them: fn^T becomes one constant (or, on CPU with weight
prepacking, the projection becomes MKL's linear, which keeps fn as its third argument), base's
split becomes three constants and scale's selects three scalars. The head matcher accepts those and
rebuilds fn, base and scale as the kernel reads them, as new constants of the GraphModule, once at
compile time (frozen weights do not change).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._inductor.pattern_matcher import stable_topological_sort

from lowering import mega_mhc as mhc_kernels

from .base import Candidate, FusionPass, NoMatch
from .graph import (MKL_LINEAR, aten, arg, dtype, frozen_value, frozen_weight, is_convert, is_last_dim, is_op,
                    keeps_leading, last_dim_parts, new_constant, only_users_in, prims, rank, scalar, unpadded,
                    val)
from .ops import mhc_fake, mhc_unsupported
from .registry import register

# Ops that move or view a tensor's elements without computing: the matcher reads through them.
LAYOUT = (aten.view, aten._unsafe_view, aten.reshape, aten.unsqueeze, aten.squeeze, aten.permute,
          aten.expand, aten.clone, aten.alias, aten.transpose, aten.t)
GEMMS = (aten.mm, aten.bmm, *MKL_LINEAR)
# Ops that read parts of a tensor (base's three parts, scale[i]): they compute nothing either.
INDEXING = (aten.split_with_sizes, aten.split, aten.slice, aten.select, aten.unbind)
F32 = torch.float32
# The kernel reads these inputs in fp32; a bf16 / fp16 one is widened by the rewrite (exact).
FP32_INPUTS = ("post", "comb", "carried_pre", "fn", "base", "scale", "norm_weight")


# ---- axes: what views, GEMMs and broadcast products do to the axes they read -------------------
#
# An axis is a tuple of atoms, the source axes it runs over in row-major order (a flatten merges
# several into one). An atom is (members, size): members are the source axes (node, dim) it is;
# a GEMM or an elementwise product pairs two axes, and the atom then has both as members (an
# expanded size-1 axis is an atom with no members). Size-1 axes are empty: they carry nothing.

def _source_axes(node: fx.Node) -> tuple:
    return tuple(() if size == 1 else ((frozenset({(node, d)}), size),) for d, size in enumerate(val(node).shape))


def _regroup(axes: tuple, shape) -> tuple | None:
    """A view's axes: the input's atoms in row-major order, grouped into the new sizes (None if the
    view splits an atom: the result mixes what the matcher tracks)."""
    atoms = [atom for axis in axes for atom in axis]
    out, i = [], 0
    for size in shape:
        group, product = [], 1
        while product < size and i < len(atoms):
            group.append(atoms[i])
            product *= atoms[i][1]
            i += 1
        if product != size:
            return None
        out.append(tuple(group))
    return tuple(out) if i == len(atoms) else None


def _forward(op: fx.Node, axes: tuple) -> tuple | None:
    """The axes of `op`'s result from those of its input (op.args[0]); None if it mixes them."""
    if is_convert(op) or is_op(op, aten.clone, aten.alias):
        return axes
    rank_in = len(axes)
    if is_op(op, aten.unsqueeze):
        d = op.args[1] % (rank_in + 1)
        return axes[:d] + ((),) + axes[d:]
    if is_op(op, aten.squeeze):
        dims = op.args[1] if len(op.args) > 1 else range(rank_in)
        dims = {d % rank_in for d in (dims if isinstance(dims, (list, tuple, range)) else [dims])}
        return tuple(a for d, a in enumerate(axes) if d not in dims or val(op.args[0]).shape[d] != 1)
    if is_op(op, aten.permute):
        return tuple(axes[d % rank_in] for d in op.args[1])
    if is_op(op, aten.transpose, aten.t):
        a, b = (d % rank_in for d in op.args[1:3]) if is_op(op, aten.transpose) else (0, rank_in - 1)
        swapped = list(axes)
        swapped[a], swapped[b] = swapped[b], swapped[a]
        return tuple(swapped)
    shape = tuple(val(op).shape)
    if is_op(op, aten.expand):
        lead = len(shape) - rank_in
        old = ((),) * lead + axes
        return tuple(a if a or size == 1 else ((frozenset(), size),) for a, size in zip(old, shape))
    if is_op(op, aten.view, aten.reshape, aten._unsafe_view):
        return _regroup(axes, shape)
    return None


def _unify(a: tuple, b: tuple) -> tuple | None:
    """Two axes paired elementwise (a broadcast product's aligned axes, a GEMM's batch or its
    contracted axes): one axis whose atoms have both as members; None if their sizes differ."""
    if not a or not b:
        return a or b
    if len(a) == len(b) and all(x[1] == y[1] for x, y in zip(a, b)):
        return tuple((x[0] | y[0], x[1]) for x, y in zip(a, b))
    if math.prod(x[1] for x in a) == math.prod(y[1] for y in b):
        return ((frozenset().union(*(x[0] for x in a + b)), math.prod(x[1] for x in a)),)
    return None


def _members(axes: tuple) -> list[frozenset]:
    """The atoms of `axes` in order (size-1 axes contribute none)."""
    return [members for axis in axes for members, _ in axis]


def _lead(source: fx.Node, skip: int, *others: fx.Node) -> list[frozenset]:
    """The atoms of `source`'s leading axes (all but its last `skip`), each paired with the same
    axis of `others` (tensors of the seam share their leading, token dims)."""
    shape = val(source).shape
    return [frozenset({(source, d)} | {(o, d) for o in others}) for d in range(len(shape) - skip) if shape[d] != 1]


def _widens(node) -> bool:
    """A dtype convert that is exact: to the same dtype, or a float widened to fp32 / fp64."""
    if not is_convert(node):
        return False
    src, out = dtype(node.args[0]), dtype(node)
    return src == out or (src is not None and src.is_floating_point and out in (torch.float32, torch.float64)
                          and src.itemsize <= out.itemsize)


def _unwiden(node: fx.Node) -> fx.Node:
    """`node` under its exact dtype converts (the parameter a `w.float()` reads)."""
    while _widens(node):
        node = node.args[0]
    return node


def _widen_path(node: fx.Node) -> list[fx.Node]:
    """The exact converts _unwiden passes."""
    path = []
    while _widens(node):
        path.append(node)
        node = node.args[0]
    return path


def _fake_f32(node: fx.Node) -> torch.Tensor:
    """node's fake value widened to fp32 (what the rewrite's convert makes of it)."""
    with val(node).fake_mode:
        return val(node).float()


@dataclass
class Traced:
    """An operand read through layout ops and exact converts down to a source tensor."""

    source: fx.Node
    axes: tuple  # of the operand, in atoms of `source`
    path: list[fx.Node]  # the layout ops from the operand down to (not including) the source


def _replay(path: list[fx.Node], axes: tuple) -> tuple | None:
    """Axes after the ops of `path` (top first, as _trace lists them), from the axes under it."""
    for op in reversed(path):
        axes = _forward(op, axes)
        if axes is None:
            return None
    return axes


def _trace(node: fx.Node, want=None, rounding: bool = False) -> Traced | None:
    """Walk down from `node` through layout ops and exact converts (never through a rounding:
    rounding X' to the stream dtype is part of the post, and X' is the rounded tensor, unless
    `rounding`); the source is the lowest node on the way for which `want` holds (default: the
    bottom). The operand's axes follow from the source's."""
    walk = [node]
    while is_op(walk[-1], *LAYOUT) or _widens(walk[-1]) or rounding and is_convert(walk[-1]):
        walk.append(walk[-1].args[0])
    picked = [i for i, n in enumerate(walk) if want is None or want(n)]
    if not picked:
        return None
    axes = _replay(walk[:picked[-1]], _source_axes(walk[picked[-1]]))
    return None if axes is None else Traced(walk[picked[-1]], axes, walk[:picked[-1]])


@dataclass
class Contraction:
    """A GEMM or a (summed) broadcast product, read as atoms: the operands it reads, the axes of its
    result, the atoms it sums over, and its compute nodes (a chain's, never shared)."""

    operands: list[Traced]
    axes: tuple
    summed: list[frozenset]
    nodes: list[fx.Node]


def _gemm_operands(core: fx.Node) -> tuple[fx.Node, fx.Node]:
    # MKL's linear (Inductor's freezing on CPU): (x, packed W, W, bias, batch) computes x @ W^T
    return (core.args[0], core.args[2]) if is_op(core, *MKL_LINEAR) else tuple(core.args[:2])


def _contract(core: fx.Node, trace=_trace) -> Contraction | None:
    """`core` (a bmm, an mm, MKL's linear, a product, or a sum of a product) as a Contraction;
    `trace(operand)` reads each operand; None if it is none of those or mixes axes."""
    if is_op(core, *GEMMS):
        if is_op(core, *MKL_LINEAR) and core.args[3] is not None:
            return None  # a bias term
        traced = [trace(o) for o in _gemm_operands(core)]
        if None in traced:
            return None
        la, ra = traced[0].axes, traced[1].axes
        if is_op(core, *MKL_LINEAR):
            ra = ra[::-1] if len(ra) == 2 else None
        if is_op(core, aten.bmm) and len(la) == len(ra) == 3:
            batch, k = _unify(la[0], ra[0]), _unify(la[2], ra[1])
            axes = (batch, la[1], ra[2])
        elif ra is not None and len(ra) == 2 and len(la) >= 2:
            k, batch = _unify(la[-1], ra[0]), ()
            axes = la[:-1] + (ra[1],)
        else:
            return None
        if k is None or batch is None:
            return None
        return Contraction(traced, axes, [m for m, _ in k], [core])
    if is_op(core, aten.sum) and is_op(core.args[0], aten.mul) and len(core.args) > 1:
        product = _contract(core.args[0], trace)
        if product is None:
            return None
        r = len(product.axes)
        dims = {d % r for d in core.args[1]}
        keep = arg(core, 2, "keepdim", False)
        axes = tuple(() if d in dims else a for d, a in enumerate(product.axes) if keep or d not in dims)
        summed = [m for d in sorted(dims) for m, _ in product.axes[d]]
        return Contraction(product.operands, axes, product.summed + summed, product.nodes + [core])
    if is_op(core, aten.mul) and all(isinstance(a, fx.Node) for a in core.args[:2]):
        traced = [trace(o) for o in core.args[:2]]
        if None in traced:
            return None
        la, ra = traced[0].axes, traced[1].axes
        r = max(len(la), len(ra))
        la, ra = ((),) * (r - len(la)) + la, ((),) * (r - len(ra)) + ra
        axes = tuple(_unify(a, b) for a, b in zip(la, ra))
        return None if None in axes else Contraction(traced, axes, [], [core])
    return None


def _contraction_at(node: fx.Node, trace=_trace) -> Contraction | None:
    """The Contraction under `node`, through the layout ops on top of it (they join its nodes)."""
    walk = [node]
    while is_op(walk[-1], *LAYOUT) or _widens(walk[-1]):
        walk.append(walk[-1].args[0])
    found = _contract(walk[-1], trace)
    if found is None:
        return None
    found.axes = _replay(walk[:-1], found.axes)
    found.nodes += walk[:-1]
    return found if found.axes is not None else None


def _lift(node: fx.Node, axes: tuple) -> tuple[fx.Node, tuple, list[fx.Node]]:
    """Up from `node` through the layout ops that are its only reader, one after the other:
    (the last of them, its axes, the ops passed)."""
    chain = []
    while len(node.users) == 1 and is_op(next(iter(node.users)), *LAYOUT):
        user = next(iter(node.users))
        lifted = _forward(user, axes)
        if lifted is None:
            break
        node, axes = user, lifted
        chain.append(user)
    return node, axes, chain


def _shaped(*shapes):
    """A `want` for _trace: a node of one of these shapes."""
    shapes = {tuple(s) for s in shapes}
    return lambda node: rank(node) is not None and tuple(val(node).shape) in shapes


# ---- small recognisers ------------------------------------------------------------------------

def _rms_stat(node) -> tuple[fx.Node, float, list[fx.Node]]:
    """1 / sqrt(mean(x^2) + eps) over the last dim, in any of its spellings -> (x, eps, nodes):
    rsqrt(v + eps) or reciprocal(sqrt(v + eps)) (times 1, as `1 / sqrt` decomposes), with
    v = mean(x^2, -1, keepdim) or sum(x^2, -1, keepdim) / size, x^2 as pow(x, 2) or x * x,
    keepdim or an unsqueeze after."""
    nodes = []
    if is_op(node, aten.mul) and any(scalar(a) == 1.0 for a in node.args[:2]):
        nodes.append(node)
        node = next(a for a in node.args[:2] if isinstance(a, fx.Node))
    if is_op(node, aten.reciprocal) and is_op(node.args[0], aten.sqrt):
        nodes += [node, node.args[0]]
        add = node.args[0].args[0]
    elif is_op(node, aten.rsqrt):
        nodes.append(node)
        add = node.args[0]
    else:
        raise NoMatch("no 1 / sqrt(mean(x^2) + eps) statistic")
    if not is_op(add, aten.add) or sum(scalar(a) is not None for a in add.args[:2]) != 1:
        raise NoMatch("no 1 / sqrt(mean(x^2) + eps) statistic")
    eps = next(scalar(a) for a in add.args[:2] if scalar(a) is not None)
    v = next(a for a in add.args[:2] if isinstance(a, fx.Node))
    nodes += [add, v]
    if is_op(v, aten.unsqueeze):  # mean(.., keepdim=False).unsqueeze(-1)
        v = v.args[0]
        nodes.append(v)
    if is_op(v, aten.mean):
        reduce, count = v, None
    elif is_op(v, aten.div) and is_op(v.args[0], aten.sum) and scalar(v.args[1]) is not None:
        reduce, count = v.args[0], scalar(v.args[1])
        nodes.append(reduce)
    else:
        raise NoMatch("no mean(x^2) under the 1 / sqrt statistic")
    square = reduce.args[0]
    if not (is_op(square, aten.pow) and scalar(square.args[1]) == 2.0
            or is_op(square, aten.mul) and square.args[0] is square.args[1]):
        raise NoMatch("the 1 / sqrt statistic does not average squares")
    nodes.append(square)
    x = square.args[0]
    dims = list(reduce.args[1]) if len(reduce.args) > 1 else []
    if len(dims) != 1 or not is_last_dim(dims[0], x):
        raise NoMatch(f"the RMS statistic's mean runs over dims {dims}, not the last dim")
    if count is not None and count != val(x).shape[-1]:
        raise NoMatch(f"the RMS statistic divides a sum of {val(x).shape[-1]} squares by {count:g}")
    return x, eps, nodes


def _users(node, *packets) -> list[fx.Node]:
    return [u for u in node.users if is_op(u, *packets)]


def _only_user(node, *packets, what: str):
    users = _users(node, *packets)
    if len(users) != 1:
        raise NoMatch(what)
    return users[0]


def _eps_add(node) -> tuple[fx.Node, float] | None:
    """node + eps (either order) -> (the add, eps), the add being node's only add reader."""
    adds = [u for u in _users(node, aten.add) if sum(scalar(a) is not None for a in u.args[:2]) == 1]
    if len(adds) != 1:
        return None
    return adds[0], next(scalar(a) for a in adds[0].args[:2] if scalar(a) is not None)


def _softmax(start: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """softmax over the last dim of `start`, in any form Inductor gives it: amax, sub, exp, sum,
    div; where its online-softmax rewrite runs (Triton on CUDA), prims.prepare_softmax_online ->
    (max, sum), sub, exp, div; or exp / sum without the max (the same function)."""
    online = _users(start, prims.prepare_softmax_online)
    if online:
        if len(online) != 1 or not is_last_dim(online[0].args[1], start):
            raise NoMatch(f"{start.name}: the comb softmax is not one online softmax over the last dim")
        prepare = online[0]
        items = {u.args[1]: u for u in prepare.users if u.target is operator.getitem}
        if set(items) != {0, 1}:
            raise NoMatch(f"{prepare.name}: the online softmax's max and sum are not both used")
        sub = _only_user(items[0], aten.sub, what=f"{prepare.name}: not exp(x - max) / sum")
        exp = _only_user(sub, aten.exp, what=f"{prepare.name}: not exp(x - max) / sum")
        soft = _only_user(exp, aten.div, what=f"{prepare.name}: not exp(x - max) / sum")
        if sub.args[0] is not start or soft.args[1] is not items[1]:
            raise NoMatch(f"{prepare.name}: not exp(x - max) / sum")
        return soft, [prepare, items[0], items[1], sub, exp, soft]
    amax = _users(start, aten.amax)
    if amax:
        if len(amax) != 1 or len(amax[0].args[1]) != 1 or not is_last_dim(amax[0].args[1][0], start):
            raise NoMatch("the comb softmax does not run over the last dim")
        sub = _only_user(amax[0], aten.sub, what="the comb softmax is not exp(x - max) / sum")
        exp = _only_user(sub, aten.exp, what="the comb softmax is not exp(x - max) / sum")
        nodes = [amax[0], sub, exp]
    else:
        exp = _only_user(start, aten.exp, what="no softmax of the comb logits")
        nodes = [exp]
    total = _only_user(exp, aten.sum, what="the comb softmax is not exp / sum")
    soft = _only_user(total, aten.div, what="the comb softmax is not exp / sum")
    if len(total.args[1]) != 1 or not is_last_dim(total.args[1][0], exp):
        raise NoMatch("the comb softmax does not run over the last dim")
    if soft.args[:2] != (exp, total):
        raise NoMatch("the comb softmax is not exp / sum")
    return soft, nodes + [total, soft]


def _normalisation(current: fx.Node) -> tuple[str, float, list[fx.Node]] | None:
    """The one Sinkhorn normalisation reading `current`: current / (current.sum(d) + eps), the sum
    keepdim or unsqueezed -> ("column" (d = -2) or "row" (d = -1), eps, nodes ending in the div)."""
    r = rank(current)
    for total in _users(current, aten.sum):
        if total.args[0] is not current or len(total.args[1]) != 1:
            continue
        d = total.args[1][0] % r
        keep = arg(total, 2, "keepdim", False)
        nodes = [total]
        if not keep:
            unsq = _users(total, aten.unsqueeze)
            if len(unsq) != 1 or unsq[0].args[1] % r != d:
                continue
            total = unsq[0]
            nodes.append(total)
        found = _eps_add(total)
        if found is None:
            continue
        add, eps = found
        div = [u for u in _users(add, aten.div) if u.args[:2] == (current, add)]
        if len(div) == 1 and d in (r - 2, r - 1):
            return ("column" if d == r - 2 else "row"), eps, nodes + [add, div[0]]
    return None


def _sinkhorn(start: fx.Node) -> tuple[fx.Node, float, int, list[fx.Node]]:
    """softmax(-1) + eps, then alternating column / row divisions by (sum + eps), starting and
    ending on columns, every one with that eps -> (comb, eps, iterations, nodes)."""
    soft, nodes = _softmax(start)
    found = _eps_add(soft)
    if found is None:
        raise NoMatch("the comb softmax is not followed by + eps")
    current, eps = found
    nodes.append(current)
    axes = []
    while (step := _normalisation(current)) is not None:
        axis, step_eps, step_nodes = step
        expect = "column" if len(axes) % 2 == 0 else "row"
        if axis != expect:
            raise NoMatch(f"Sinkhorn does not start on a column normalisation" if not axes else
                          f"Sinkhorn normalisation {len(axes) + 1} is over {axis}s, not {expect}s")
        if step_eps != eps:
            raise NoMatch(f"Sinkhorn normalisation {len(axes) + 1} adds eps {step_eps!r}, not {eps!r}")
        axes.append(axis)
        nodes += step_nodes
        current = step_nodes[-1]
    if not axes or axes[-1] != "column":
        raise NoMatch("Sinkhorn does not end on a column normalisation")
    return current, eps, (len(axes) + 1) // 2, nodes


def _through_layout(node) -> fx.Node:
    """The tensor under any stack of layout ops (views, permutes, unsqueezes) and converts."""
    while is_op(node, *LAYOUT) or is_convert(node):
        node = node.args[0]
    return node


def _affine(node, mix_part, base_part, scale_index):
    """m * scale[i] + base_part, in any operand order -> (nodes, the scale tensor), or NoMatch."""
    if not is_op(node, aten.add):
        raise NoMatch("coefficient affine map not found")
    a, b = node.args[:2]
    mul, base = (a, b) if is_op(a, aten.mul) and _through_layout(b) is base_part else (b, a)
    if _through_layout(base) is not base_part or not is_op(mul, aten.mul):
        raise NoMatch(f"coefficient affine map {scale_index} does not add base's part {scale_index}")
    m, s = mul.args[:2] if _through_layout(mul.args[0]) is mix_part else mul.args[1::-1]
    if _through_layout(m) is not mix_part:
        raise NoMatch("coefficient affine map does not read the mix")
    views = [x for x in (m, base) if x is not mix_part and x is not base_part]  # e.g. HF's [n, n] views
    read = _unwiden(s)  # scale[i], perhaps widened after the select
    nodes = [node, mul, *views] + _widen_path(s)
    if is_op(read, aten.select) and read.args[1] == 0 and read.args[2] == scale_index:  # scale[i]
        return nodes + [read], _unwiden(read.args[0])
    if read.target is operator.getitem and is_op(read.args[0], aten.unbind) and read.args[1] == scale_index:
        return nodes + [read, read.args[0]], _unwiden(read.args[0].args[0])  # scale.unbind(0)[i]
    if read.op == "get_attr":  # a frozen scale[i]: Inductor's freezing folded the select into a constant
        return nodes, read
    raise NoMatch(f"coefficient affine map does not read scale[{scale_index}]")


def _frozen_concat(graph: fx.Graph, parts: list[fx.Node], name: str) -> fx.Node:
    """base [(2+n)n] or scale [3] from the constants freezing folded their slices into (each
    base_pre / base_post / base_comb, each scale[i])."""
    values = [frozen_value(p) for p in parts]
    if any(v is None for v in values):
        raise NoMatch(f"the coefficient {name} is frozen in part only")
    if len({v.dtype for v in values}) != 1:
        raise NoMatch(f"the frozen pieces of the coefficient {name} differ in dtype")
    return new_constant(graph, parts[-1], name, torch.cat([v.reshape(-1) for v in values]))


# ---- the coefficient head ---------------------------------------------------------------------

@dataclass
class Head:
    """A site's coefficient head: stream in, (pre, post, comb) out."""

    stream: fx.Node
    fn: fx.Node
    base: fx.Node
    scale: fx.Node
    stat_eps: float
    hc_eps: float
    iters: int
    pre: fx.Node
    post: fx.Node
    comb: fx.Node
    nodes: list[fx.Node] = field(default_factory=list)


def _streams_for(width: int) -> list[int]:
    """n for an fn of `width` rows: (2+n)n (a coefficient head) or n (V4's pre-only HyperHead)."""
    n = round(math.sqrt(width + 1) - 1)
    return [k for k in (n, width) if k >= 1 and (k == width or (2 + k) * k == width)]


def _weight(core: fx.Node) -> tuple[Traced, int] | None:
    """The rank-2 weight a GEMM reads and which of its operands it is (0 or 1)."""
    for index, operand in ((1, _gemm_operands(core)[1]), (0, _gemm_operands(core)[0])):
        traced = _trace(operand)
        if traced is not None and rank(traced.source) == 2:
            return traced, index
    return None


def _projection(core: fx.Node):
    """x @ fn^T of a flattened [.., n, D] stream X: (X, n, fn's source, whether it is fn^T [nD, W],
    Contraction, the RMS statistic scaling x (HF's order) or None, the nodes between it and the
    GEMM). NoMatch(candidate=False) if `core` is no such projection."""
    weight = _weight(core) if is_op(core, *GEMMS) else None
    if weight is None:
        raise NoMatch("not a projection by a weight", candidate=False)
    w, index = weight
    # the weight operand's contracted axis: an mm's lhs [M, K] or rhs [K, N], a bmm's [B, M, K] or
    # [B, K, N], MKL's W [N, K]
    k_position = 1 if is_op(core, *MKL_LINEAR) else (len(w.axes) - 1 if index == 0 else len(w.axes) - 2)
    k_axis = [d for d in (0, 1) if any((w.source, d) in members for members, _ in w.axes[k_position])]
    if len(w.axes) != (3 if is_op(core, aten.bmm) else 2) or len(k_axis) != 1:
        raise NoMatch("not a projection by a weight", candidate=False)
    transposed = k_axis[0] == 0  # the weight is fn^T [nD, W] (a frozen constant)
    width, K = val(w.source).shape[1 if transposed else 0], val(w.source).shape[k_axis[0]]
    x_operand = _gemm_operands(core)[1 - index]
    for n in _streams_for(width):
        if K % n:
            continue
        def want(node, n=n):  # the [.., n, D] stream the flatten reads
            return rank(node) is not None and rank(node) >= 3 and tuple(val(node).shape[-2:]) == (n, K // n)

        x, scaled_by, scaled_path = _trace(x_operand, want), None, []
        if x is None:  # HF's order: the projection reads x * r
            under = _trace(x_operand)
            if under is not None and is_op(under.source, aten.mul):
                mul = under.source
                for a, b in (mul.args[:2], mul.args[1::-1]):
                    inner = _trace(a, want) if isinstance(a, fx.Node) and isinstance(b, fx.Node) else None
                    if inner is not None and is_op(b, aten.rsqrt, aten.reciprocal, aten.mul):
                        axes = _replay(under.path, inner.axes)
                        if axes is not None:
                            x, scaled_by, scaled_path = Traced(inner.source, axes, inner.path), b, under.path + [mul]
                        break
        if x is None:
            rounded = _trace(x_operand, want, rounding=True)
            cast = [c for c in (rounded.path if rounded else []) if is_convert(c) and not _widens(c)]
            if cast:  # e.g. an fp64 stream read as fp32: the kernel reads its stream dtype as it is
                names = [str(dtype(c)).removeprefix("torch.") for c in (cast[0].args[0], cast[0])]
                raise NoMatch(f"the fn projection reads a [.., {n}, {K // n}] stream rounded from {names[0]} to "
                              f"{names[1]}: the kernel reads fp32, bf16 or fp16 streams as they are")
            continue
        stream = x.source
        traced = {x_operand: x, _gemm_operands(core)[index]: w}
        found = _contract(core, trace=lambda o: traced[o])
        r = rank(stream)
        k_atoms = {(w.source, k_axis[0]), (stream, r - 2), (stream, r - 1)}
        if found is None or found.summed != [frozenset(k_atoms)] or _members(found.axes) != (
                _lead(stream, 2) + [frozenset({(w.source, 1 - k_axis[0])})]):
            raise NoMatch("the fn projection does not contract the flattened stream's n*D values with fn's")
        return stream, n, w.source, transposed, found, scaled_by, scaled_path
    raise NoMatch("not a projection of a flattened [.., n, D] stream", candidate=False)


def _unpad_projections(graph: fx.Graph) -> None:
    """Put each fn projection that Inductor's shape padding padded (graph.unpadded: on GPUs, e.g.
    T = 1 rows of bf16) back as the GEMM of its unpadded operands, so that its seam reads as
    written. Exact: the padding's zeros add nothing, and its slices cut them off again. GEMMs that
    are no projection of a flattened stream keep their padding."""
    for gemm in [n for n in graph.nodes if is_op(n, aten.mm, aten.bmm)]:
        operands = [unpadded(a) for a in gemm.args[:2]]
        if operands == list(gemm.args[:2]):
            continue
        end = gemm
        while len(end.users) == 1 and keeps_leading(next(iter(end.users))):
            end = next(iter(end.users))
        with graph.inserting_before(gemm):
            plain = graph.call_function(gemm.target, tuple(operands))
        plain.meta["val"] = gemm.target(*(val(a) for a in operands))  # (fake tensors: shapes only)
        try:
            if end is gemm or val(end).shape != val(plain).shape:
                raise NoMatch("not padding pad_mm's slices cut off again", candidate=False)
            _projection(plain)
        except NoMatch as e:
            if e.candidate:  # a projection: its own match says why it does not fuse
                end.replace_all_uses_with(plain)
            else:
                graph.erase_node(plain)
            continue
        plain.meta["stack_trace"] = gemm.meta.get("stack_trace")
        end.replace_all_uses_with(plain)


def _match_head(core: fx.Node) -> Head:
    """The fn projection `core` of an mHC site -> the whole coefficient head."""
    stream, n, fn_source, transposed, projection, scaled_by, scaled_path = _projection(core)
    width = val(fn_source).shape[1 if transposed else 0]
    if (2 + n) * n != width:
        raise NoMatch(f"a pre-only head (fn has n = {n} rows: V4's HyperHead), not an mHC site's (2+n)n")
    if transposed and fn_source.op != "get_attr":
        raise NoMatch("the fn projection reads a weight stored as fn^T [nD, (2+n)n]: not a supported layout")
    fn = frozen_weight(fn_source, width, transposed, "fn projection weight") if fn_source.op == "get_attr" else None
    fn = fn if fn is not None else _unwiden(fn_source)
    top, axes, lifted = _lift(core, projection.axes)
    nodes = projection.nodes + lifted + scaled_path
    r = rank(stream)
    flat = _lead(stream, 2) + [frozenset({(stream, r - 2)}), frozenset({(stream, r - 1)})]
    if scaled_by is not None:  # (x * r) @ fn^T
        rsqrt, mix = scaled_by, top
    else:  # (x @ fn^T) * r, either operand order
        muls = [u for u in _users(top, aten.mul) if any(is_op(a, aten.rsqrt, aten.reciprocal, aten.mul)
                                                         for a in u.args[:2] if a is not top)]
        if len(top.users) != 1 or len(muls) != 1:
            raise NoMatch("the fn projection is not scaled by an RMS statistic")
        mix = muls[0]
        rsqrt = next(a for a in mix.args[:2] if a is not top)
        nodes.append(mix)
    stat_x, stat_eps, stat_nodes = _rms_stat(rsqrt)
    stat = _trace(stat_x, lambda node: node is stream)
    if stat is None or _members(stat.axes) != flat:
        raise NoMatch("the RMS statistic does not read the flattened stream the fn projection reads")
    nodes += stat_nodes
    sizes = [n, n, n * n]
    parts = last_dim_parts(mix, sizes)
    if parts is None:
        raise NoMatch(f"the coefficient mix is not read as its [{n}, {n}, {n * n}] parts")
    (m_pre, m_post, m_comb), split = parts
    nodes += split + [m_pre, m_post, m_comb]
    # the affine maps, each m_part * scale[i] + base_part; base split or sliced like the mix
    comb_mix = m_comb if _users(m_comb, aten.mul) else _only_user(
        m_comb, aten.view, aten.reshape, aten._unsafe_view, what="the comb mix is not reshaped to [n, n]")
    adds = []
    for part in (m_pre, m_post, comb_mix):
        mul = _only_user(part, aten.mul, what="the coefficient mix is not scaled")
        adds.append(_only_user(mul, aten.add, what="the coefficient mix is not offset by base"))
    base_items = [next((_through_layout(a) for a in add.args[:2] if not is_op(a, aten.mul)), None) for add in adds]
    frozen = all(b is not None and b.op == "get_attr" for b in base_items)
    if not frozen:
        whole = {b.args[0] if is_op(b, aten.slice) else b.args[0].args[0] if b is not None
                 and b.target is operator.getitem else None for b in base_items}
        base = whole.pop() if len(whole) == 1 else None
        found = last_dim_parts(base, sizes) if isinstance(base, fx.Node) else None
        if found is None or found[0] != base_items:
            raise NoMatch("the coefficient base is not split like the mix")
        nodes += found[1] + base_items
        base = _unwiden(base)
    scales = []
    for i, (add, part) in enumerate(zip(adds, (m_pre, m_post, m_comb))):
        affine_nodes, scale = _affine(add, part, base_items[i], i)
        nodes += affine_nodes
        scales.append(scale)
    if frozen:  # one base and one scale, as the kernel reads them, from the folded pieces
        base = _frozen_concat(core.graph, base_items, "base")
        scale = _frozen_concat(core.graph, scales, "scale")
    elif len(set(scales)) != 1:
        raise NoMatch("the three affine maps read different scale tensors")
    else:
        scale = scales[0]
    # pre = sigmoid(.) + hc_eps; post = 2 * sigmoid(.)
    sig_pre = _only_user(adds[0], aten.sigmoid, what="the pre gate is not sigmoid(.) + eps")
    pre_eps = _eps_add(sig_pre)
    if pre_eps is None:
        raise NoMatch("the pre gate is not sigmoid(.) + eps")
    pre = pre_eps[0]
    sig_post = _only_user(adds[1], aten.sigmoid, what="the post gate is not 2 * sigmoid(.)")
    post = _only_user(sig_post, aten.mul, what="the post gate is not 2 * sigmoid(.)")
    if sig_post not in post.args[:2] or 2.0 not in [scalar(a) for a in post.args[:2]]:
        raise NoMatch("post gate is not 2 * sigmoid")
    # [n, n] either before the affine map (HF) or after it (ours)
    comb_logits = ([adds[2]] if rank(adds[2]) == rank(m_comb) + 1 else
                   [u for u in adds[2].users if is_op(u, aten.view, aten.reshape, aten._unsafe_view)])
    if len(comb_logits) != 1 or tuple(val(comb_logits[0]).shape[-2:]) != (n, n):
        raise NoMatch("comb logits are not reshaped to [n, n]")
    comb, hc_eps, iters, sink_nodes = _sinkhorn(comb_logits[0])
    if pre_eps[1] != hc_eps:
        raise NoMatch(f"pre's eps differs from Sinkhorn's eps ({pre_eps[1]!r} against {hc_eps!r})")
    nodes += [sig_pre, pre, sig_post, post, comb_logits[0], comb_mix, *sink_nodes]
    return Head(stream, fn, base, scale, stat_eps, hc_eps, iters, pre, post, comb, list(dict.fromkeys(nodes)))


def _head_readers(stream: fx.Node) -> list[fx.Node]:
    """GEMMs that read `stream` through views, exact converts and a product (HF's x * r): its
    coefficient head's fn projection, if it has one."""
    found, frontier, seen = [], [(stream, 0)], set()
    while frontier:
        node, depth = frontier.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if is_op(user, *GEMMS):
                found.append(user)
            elif depth < 6 and (is_op(user, *LAYOUT, aten.mul) or _widens(user)):
                frontier.append((user, depth + 1))
    return found


# ---- the post --------------------------------------------------------------------------------

@dataclass
class Post:
    """X' = (post[j] y + sum_i comb[i, j] X[i]).to(dtype): its inputs and compute nodes."""

    streams: fx.Node
    y: fx.Node
    post: fx.Node
    comb: fx.Node
    nodes: list[fx.Node]


def _post_add(stream: fx.Node) -> fx.Node | None:
    """The add that makes X' (the stream itself, or under its rounding to the stream dtype)."""
    add = stream.args[0] if is_convert(stream) and not _widens(stream) else stream
    return add if is_op(add, aten.add) and all(isinstance(a, fx.Node) for a in add.args[:2]) else None


def _match_post(stream: fx.Node) -> Post | None:
    """The post that makes `stream`; None if nothing post-like does (a first seam, an Engram
    injection), NoMatch if a post-like add is not the reference's post."""
    add = _post_add(stream)
    if add is None:
        return None
    shape = tuple(val(stream).shape)
    lead, n, D = shape[:-2], shape[-2], shape[-1]
    if n == D:
        return None  # comb [.., n, n] and X [.., n, D] cannot be told apart by their shapes
    # each operand read down to the lowest tensor of its shape (X, not the embedding a first stream
    # is expanded from)
    gate_want, mix_want = _shaped(lead + (n,), lead + (D,)), _shaped(lead + (n, n), lead + (n, D))
    for gate_top, mix_top in (add.args[:2], add.args[1::-1]):
        gate = _contraction_at(gate_top, lambda o: _trace(o, gate_want))
        mix = _contraction_at(mix_top, lambda o: _trace(o, mix_want))
        if gate is None or mix is None or gate.summed or not mix.summed:
            continue
        gate_src = {tuple(val(t.source).shape): t.source for t in gate.operands}
        mix_src = {tuple(val(t.source).shape): t.source for t in mix.operands}
        if set(gate_src) != {lead + (n,), lead + (D,)} or set(mix_src) != {lead + (n, n), lead + (n, D)}:
            continue
        post, y = gate_src[lead + (n,)], gate_src[lead + (D,)]
        comb, streams = mix_src[lead + (n, n)], mix_src[lead + (n, D)]
        computes = {dtype(x) for x in [add] + gate.nodes + mix.nodes if not is_op(x, *LAYOUT)}
        if computes != {F32}:
            wide = sorted(str(d).removeprefix("torch.") for d in computes - {F32})
            raise NoMatch(f"the post mixes in {', '.join(wide)} (HF's bf16 post rounds post and comb first), "
                          f"not in fp32 like the reference")
        r = len(shape)
        if mix.summed == [frozenset({(comb, r - 1), (streams, r - 2)})]:
            raise NoMatch("the residual mix is C X (it sums over comb's second index), not C^T X")
        if mix.summed != [frozenset({(comb, r - 2), (streams, r - 2)})] or _members(mix.axes) != (
                _lead(streams, 2, comb) + [frozenset({(comb, r - 1)}), frozenset({(streams, r - 1)})]):
            raise NoMatch("the residual mix is not C^T X (sum over comb's first index)")
        if _members(gate.axes) != _lead(y, 1, post) + [frozenset({(post, r - 2)}), frozenset({(y, r - 2)})]:
            raise NoMatch("the post gate is not post[.., j] * y[.., d]")
        nodes = [add] + gate.nodes + mix.nodes + ([stream] if stream is not add else [])
        return Post(streams, y, post, comb, nodes)
    return None


# ---- the collapse and its norm ----------------------------------------------------------------

@dataclass
class Collapse:
    """c = (sum_k pre[k] X'[k]).to(dtype), u = RMSNorm(c): the pre it reads, the norm, u."""

    pre: fx.Node
    norm_weight: fx.Node
    norm_eps: float
    c: fx.Node  # the collapse as the norm reads it (rounded to the stream dtype)
    u: fx.Node
    nodes: list[fx.Node]


def _mul_leaves(node: fx.Node, keep: fx.Node) -> list[fx.Node]:
    """The factors of a product tree (x * r * w in any association): the operands of `node`,
    opening products read only inside it (and never `keep`)."""
    leaves = []
    for a in node.args[:2]:
        if is_op(a, aten.mul) and a is not keep and len(a.users) == 1:
            leaves += _mul_leaves(a, keep)
        else:
            leaves.append(a)
    return leaves


def _match_norm(c: fx.Node, stream: fx.Node) -> tuple[fx.Node, float, fx.Node, list[fx.Node]]:
    """u = (c * r * w).to(dtype), r = 1 / sqrt(mean(c^2) + eps), the product in any order ->
    (w, eps, u, nodes)."""
    reasons, frontier, stats = [], [(c, 0)], []
    seen = set()
    while frontier:  # the statistic: a few steps above c
        node, depth = frontier.pop()
        for user in node.users:
            if user not in seen and depth < 8:
                seen.add(user)
                if is_op(user, aten.rsqrt, aten.reciprocal):
                    stats.append(user)
                frontier.append((user, depth + 1))
    D = val(c).shape[-1]
    for r in stats:
        one = [u for u in r.users if is_op(u, aten.mul) and 1.0 in [scalar(a) for a in u.args[:2]]]
        r = one[0] if len(r.users) == 1 and one else r  # `1 / sqrt` is reciprocal(sqrt) times 1
        try:
            x, eps, stat_nodes = _rms_stat(r)
        except NoMatch as e:
            reasons.append(e.reason)
            continue
        if _unwiden(x) is not c:
            reasons.append("the norm's statistic does not read the collapse")
            continue
        for top in _users(r, aten.mul):
            for _ in range(3):  # up the product tree until it holds c, r and the weight
                leaves = _mul_leaves(top, r)
                xs = [leaf for leaf in leaves if _unwiden(leaf) is c]
                ws = [leaf for leaf in leaves if leaf not in xs and leaf is not r and rank(leaf) == 1
                      and val(leaf).shape[0] == D]
                if len(leaves) == 3 and r in leaves and len(xs) == 1 and len(ws) == 1:
                    out = [u for u in top.users if is_convert(u) and not _widens(u)]
                    u = out[0] if out else top
                    if dtype(u) != dtype(stream):
                        raise NoMatch(f"the norm's output stays {str(dtype(u)).removeprefix('torch.')}, not "
                                      f"rounded to the stream dtype")
                    return (_unwiden(ws[0]), eps, u, stat_nodes + [top] + _products(top, r) + _widen_path(xs[0])
                            + _widen_path(x) + out)
                if len(top.users) != 1 or not is_op(next(iter(top.users)), aten.mul):
                    break
                top = next(iter(top.users))
        reasons.append("the norm is not c * r * weight")
    raise NoMatch("the collapse is not normalised by an RMSNorm over the last dim"
                  + (f" ({', '.join(dict.fromkeys(reasons))})" if reasons else ""))


def _products(node: fx.Node, keep: fx.Node) -> list[fx.Node]:
    """The products _mul_leaves opened."""
    out = []
    for a in node.args[:2]:
        if is_op(a, aten.mul) and a is not keep and len(a.users) == 1:
            out += [a] + _products(a, keep)
    return out


def _collapse_cores(stream: fx.Node) -> list[fx.Node]:
    """Products summed, and bmms, that read `stream` through views and exact converts."""
    found, frontier, seen = [], [stream], set()
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if is_op(user, *LAYOUT) or _widens(user):
                frontier.append(user)
            elif is_op(user, aten.mul):
                found += _users(user, aten.sum)
            elif is_op(user, aten.bmm):
                found.append(user)
    return found


def _match_collapse(stream: fx.Node, whose: str) -> Collapse:
    """The hc_pre + RMSNorm reading `stream` (`whose` stream: for the reason), or NoMatch saying
    what is missing."""
    shape = tuple(val(stream).shape)
    lead, n, D = shape[:-2], shape[-2], shape[-1]
    r = len(shape)
    want = lambda node: node is stream or tuple(val(node).shape) == lead + (n,)  # noqa: E731
    reasons = []
    for core in _collapse_cores(stream):
        found = _contract(core, lambda o: _trace(o, want))
        if found is None or stream not in [t.source for t in found.operands]:
            continue
        pre = next((t.source for t in found.operands if t.source is not stream), None)
        if pre is None or tuple(val(pre).shape) != lead + (n,):
            continue
        top, axes, lifted = _lift(core, found.axes)
        if found.summed != [frozenset({(pre, r - 2), (stream, r - 2)})] or _members(axes) != (
                _lead(stream, 2, pre) + [frozenset({(stream, r - 1)})]):
            reasons.append("the product of pre and X' is not summed over the streams")
            continue
        rounded = [u for u in top.users if is_convert(u) and dtype(u) == dtype(stream) and not _widens(u)]
        c = rounded[0] if rounded else top  # (torch 2.11 folds c's round trip when only the norm reads it)
        try:
            weight, eps, u, norm_nodes = _match_norm(c, stream)
        except NoMatch as e:
            reasons.append(e.reason)
            continue
        return Collapse(pre, weight, eps, c, u, found.nodes + lifted + rounded + norm_nodes)
    raise NoMatch(f"no hc_pre + RMSNorm reads {whose}" + (f": {'; '.join(dict.fromkeys(reasons))}" if reasons else ""))


# ---- the pass --------------------------------------------------------------------------------

def _kernel_spec(candidate: Candidate) -> mhc_kernels.MhcSpec:
    return mhc_kernels.MhcSpec(**{k: v for k, v in candidate.spec.items() if k != "left_unfused"})


def _op_args(candidate: Candidate, inputs: dict | None = None) -> tuple:
    """megafuse::mega_mhc's arguments for a candidate (graph nodes, or `inputs`, and the spec's scalars)."""
    s, i = candidate.spec, inputs or candidate.inputs
    return (i["streams"], i["y"], i["post"], i["comb"], i["carried_pre"], i["fn"], i["base"], i["scale"],
            i["norm_weight"], s["sinkhorn_iters"], s["hc_eps"], s["stat_eps"], s["norm_eps"], s["has_post"],
            s["has_coefficients"], s["pre"], i.get("fn_pieces"))


def _widened(node: fx.Node | None) -> bool:
    """An fp32 kernel input the graph holds in bf16 / fp16: the rewrite widens it (exact)."""
    return isinstance(node, fx.Node) and dtype(node) in (torch.bfloat16, torch.float16)


def _is_mix(node: fx.Node) -> bool:
    """A post's residual mix could sit here: a bmm, or a broadcast product summed over one axis."""
    if is_op(node, aten.bmm):
        return True
    return (is_op(node, aten.sum) and is_op(node.args[0], aten.mul) and rank(node.args[0]) is not None
            and rank(node.args[0]) >= 4 and len(node.args) > 1 and len(node.args[1]) == 1)


@register
class MegaMhcPass(FusionPass):
    name = "mega_mhc"
    description = "mHC seam: previous post + coefficients (RMS, fn GEMM, sigmoid, Sinkhorn) + pre + RMSNorm in one kernel"
    op = "megafuse::mega_mhc"
    run_order = 10  # ARCHITECTURE.md: mhc, then gate

    def __init__(self, **options):
        super().__init__(**options)
        self._unfused_heads: dict[fx.Node, str] = {}

    def anchors(self, graph: fx.Graph):
        # every coefficient head first (a head's match takes its post along), then the posts whose
        # stream no matched head reads (final collapses, and seams whose head did not match)
        self._unfused_heads = {}  # fn projection -> why its seam did not fuse (a post's note says it)
        _unpad_projections(graph)
        projections = [n for n in graph.nodes if is_op(n, *GEMMS) and _weight(n) is not None]
        taken = set(projections)
        return projections + [n for n in graph.nodes if n not in taken and _is_mix(n)]

    def match(self, anchor: fx.Node) -> Candidate:
        if is_op(anchor, *GEMMS) and _weight(anchor) is not None:
            try:
                return self._match_seam(anchor)
            except NoMatch as e:
                if e.candidate:
                    self._unfused_heads[anchor] = e.reason
                raise
        return self._match_final(anchor)

    def _match_seam(self, core: fx.Node) -> Candidate:
        head = _match_head(core)
        collapse = _match_collapse(head.stream, "the stream of this coefficient head")
        notes = []
        try:
            post = _match_post(head.stream)
        except NoMatch as e:
            post = None
            notes.append(f"the previous post stays unfused: {e.reason}")
        else:
            if post is None:
                notes.append("the stream does not come straight from a post (first seam or an Engram injection "
                             "between): any previous post stays unfused")
        pre_mode = "fresh" if collapse.pre is head.pre else "carried"
        return self._candidate(core, head.stream, post, head, collapse, pre_mode, notes)

    def _match_final(self, core: fx.Node) -> Candidate:
        # the residual mix of a post: up to the add that makes X', then X' must be collapsed here
        top = core
        while len(top.users) == 1 and is_op(next(iter(top.users)), *LAYOUT):
            top = next(iter(top.users))
        add = [u for u in top.users if is_op(u, aten.add)]
        if len(top.users) != 1 or len(add) != 1:
            raise NoMatch("not an mHC post", candidate=False)
        rounded = [u for u in add[0].users if is_convert(u) and not _widens(u)]
        stream = rounded[0] if len(rounded) == 1 else add[0]
        if rank(stream) is None or rank(stream) < 3 or not stream.users:
            raise NoMatch("not an mHC post", candidate=False)
        try:
            post = _match_post(stream)
        except NoMatch as e:
            post_reason = e.reason
        else:
            if post is None:
                raise NoMatch("not an mHC post", candidate=False)
            post_reason = None
        heads = _head_readers(stream)
        try:
            collapse = _match_collapse(stream, "the post's stream")
        except NoMatch as e:
            if heads or not _collapse_cores(stream):  # (a seam: its head's anchor reports it)
                raise NoMatch("the post's stream is not collapsed here", candidate=False) from None
            raise NoMatch(e.reason if post_reason is None else f"{post_reason}; {e.reason}") from None
        if post_reason is not None:
            raise NoMatch(post_reason)
        # a coefficient head that reads X' but did not fuse (its anchor came first): say why here too
        notes = [f"the coefficient head reading X' stays unfused: {self._unfused_heads[reader]}"
                 for reader in heads if reader in self._unfused_heads]
        return self._candidate(core, stream, post, None, collapse, "carried", notes, partial=bool(notes))

    def _candidate(self, anchor, stream, post, head, collapse, pre_mode, notes, partial=False) -> Candidate:
        nodes = list(collapse.nodes) + (post.nodes if post is not None else []) + (head.nodes if head else [])
        n, dim = val(stream).shape[-2], val(stream).shape[-1]
        outputs = {"u": collapse.u}
        if post is not None:
            outputs["stream"] = stream
        if head is not None:
            outputs.update(pre=head.pre, post=head.post, comb=head.comb)
        prefix = "; ".join(notes) + ", and " if partial else ""
        inside = set(nodes)
        for node in nodes:
            if node not in outputs.values() and not only_users_in(node, inside):
                raise NoMatch(f"{prefix}intermediate {node.name} is also used outside the mHC seam")
        # the reference computes every step in fp32 and rounds X', c and u only
        roundings = {stream, collapse.c, collapse.u}
        for node in nodes:
            reads = is_op(node, *LAYOUT, *INDEXING) or node.target is operator.getitem
            if node not in roundings and not reads and isinstance(val(node), torch.Tensor) and dtype(node) != F32:
                raise NoMatch(f"{prefix}{node.name} computes in {str(dtype(node)).removeprefix('torch.')}: the "
                              f"reference computes the seam in fp32 and rounds only X', the collapse and u")
        spec = {
            "n": int(n), "dim": int(dim),
            "sinkhorn_iters": head.iters if head else 0, "hc_eps": head.hc_eps if head else 0.0,
            "stat_eps": head.stat_eps if head else 0.0, "norm_eps": collapse.norm_eps,
            "has_post": post is not None, "has_coefficients": head is not None, "pre": pre_mode,
            "stream_dtype": str(dtype(stream)).removeprefix("torch."),
        }
        inputs = {
            "streams": post.streams if post is not None else stream, "y": post.y if post else None,
            "post": post.post if post else None, "comb": post.comb if post else None,
            "carried_pre": collapse.pre if pre_mode == "carried" else None,
            "fn": head.fn if head else None, "base": head.base if head else None,
            "scale": head.scale if head else None, "norm_weight": collapse.norm_weight,
        }
        graph_nodes = list(anchor.graph.nodes)
        order = {n_: i for i, n_ in enumerate(graph_nodes)}
        chain = sorted(inside, key=order.get)
        # The fused op goes right after its last input. Readers of its outputs that Inductor
        # hoisted earlier (a view right after the value it reads) are moved after it by the
        # stable topological sort the base runs after every pass.
        last_input = max((order[a] for a in inputs.values() if isinstance(a, fx.Node)), default=-1)
        # An input computed from the chain itself would make the fused op its own ancestor: the
        # match is wrong, not fusable (seen on CUDA / torch 2.11 graphs); leave it unfused.
        # The graph is topologically sorted, so a path from the chain to an input runs through
        # nodes before that input: the search stops at the last input (not the end of the graph).
        downstream, frontier = set(), list(chain)
        while frontier:
            node = frontier.pop()
            for reader in node.users:
                if reader not in downstream and order.get(reader, last_input + 1) <= last_input:
                    downstream.add(reader)
                    frontier.append(reader)
        cyclic = [name for name, a in inputs.items() if isinstance(a, fx.Node) and a in downstream]
        if cyclic:
            raise NoMatch(f"{prefix}the seam's inputs {cyclic} are computed from the seam itself")
        return Candidate(anchor, chain, spec | ({"left_unfused": notes} if notes else {}),
                         inputs=inputs, outputs=outputs, insert_before=graph_nodes[last_input + 1])

    def check(self, candidate: Candidate) -> str | None:
        reason = mhc_kernels.unsupported_reason(_kernel_spec(candidate))
        if reason is None:
            # The launch's own input checks, on the fake tensors as the rewrite passes them (with
            # bf16 / fp16 parameters widened). E.g. an fp32 stream with an fp64 y stays unfused.
            fakes = {k: (_fake_f32(a) if _widened(a) and k in FP32_INPUTS else val(a)) if isinstance(a, fx.Node)
                     else a for k, a in candidate.inputs.items()}
            reason = mhc_unsupported(*_op_args(candidate, fakes))
        if reason is not None and candidate.spec["has_coefficients"]:
            self._unfused_heads[candidate.anchor] = reason
        return reason

    def rewrite(self, graph: fx.Graph, candidate: Candidate) -> fx.Node:
        outs = candidate.outputs
        inputs = candidate.inputs
        fn = frozen_value(inputs["fn"])
        spec = _kernel_spec(candidate)
        with graph.inserting_before(candidate.insert_before):
            for name in FP32_INPUTS:
                if _widened(inputs[name]):  # a bf16 / fp16 parameter: exact in fp32, which the kernel reads
                    wide = graph.call_function(prims.convert_element_type.default, (inputs[name], F32))
                    wide.meta["val"] = _fake_f32(inputs[name])
                    inputs[name] = wide
        if fn is not None and mhc_kernels.projects_bf16_pieces(spec):
            # a frozen fn does not change: its bf16 pieces are made here, once, so that the kernel
            # loads them instead of splitting fn in every token tile (LaunchConfig.presplit_fn)
            inputs["fn_pieces"] = new_constant(graph, inputs["fn"], "fn_pieces",
                                               mhc_kernels.split_fn(fn.float(), spec))
        args = _op_args(candidate)
        with graph.inserting_before(candidate.insert_before):
            fused = graph.call_function(torch.ops.megafuse.mega_mhc.default, args)
            fused.meta["val"] = mhc_fake(*(val(a) if isinstance(a, fx.Node) else a for a in args))
            items = {}
            for index, name in enumerate(("stream", "u", "pre", "post", "comb")):
                item = graph.call_function(operator.getitem, (fused, index))
                item.meta["val"] = fused.meta["val"][index]
                items[name] = item
        for node in (fused, *items.values()):
            node.meta["stack_trace"] = candidate.anchor.meta.get("stack_trace")
        for name, old in outs.items():
            old.replace_all_uses_with(items[name])
        # the replaced chain goes now, so that no later anchor (a post's mix) reads it again; a reader
        # of an output that Inductor hoisted above the fused op moves after it first (DCE lints)
        stable_topological_sort(graph)
        graph.eliminate_dead_code()
        return fused
