"""Matching the pieces of the mHC seam (passes/mega_mhc.py composes them into one candidate).

The coefficient head (the fn projection and its RMS statistic, the affine maps, the sigmoid gates,
the softmax and the Sinkhorn rounds), the post that makes X', and the collapse with its RMSNorm:
each matcher returns its piece's inputs and compute nodes, or raises NoMatch with the reason. The
products and GEMMs are read as contractions over atoms (passes/mhc_axes.py).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .base import NoMatch
from .graph import (MKL_LINEAR, aten, arg, dtype, frozen_value, frozen_weight, is_convert, is_last_dim, is_op,
                    keeps_leading, last_dim_parts, new_constant, prims, rank, scalar, shape, sole_user, unpadded, val)
from .mhc_axes import (GEMMS, LAYOUT, Traced, atom_members, contract, contraction_at, gemm_operands, has_shape,
                       leading_atoms, lift, replay, trace, unwiden, widen_path, widens)

F32 = torch.float32  # the reference computes the whole seam in fp32


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
            raise NoMatch("Sinkhorn does not start on a column normalisation" if not axes else
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
    read = unwiden(s)  # scale[i], perhaps widened after the select
    nodes = [node, mul, *views] + widen_path(s)
    if is_op(read, aten.select) and read.args[1] == 0 and read.args[2] == scale_index:  # scale[i]
        return nodes + [read], unwiden(read.args[0])
    if read.target is operator.getitem and is_op(read.args[0], aten.unbind) and read.args[1] == scale_index:
        return nodes + [read, read.args[0]], unwiden(read.args[0].args[0])  # scale.unbind(0)[i]
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


def gemm_weight(core: fx.Node) -> tuple[Traced, int] | None:
    """The rank-2 weight a GEMM reads and which of its operands it is (0 or 1). A weight has a
    static shape (a symbolic size is a dynamic row count: an activation)."""
    for index, operand in ((1, gemm_operands(core)[1]), (0, gemm_operands(core)[0])):
        traced = trace(operand)
        if traced is not None and rank(traced.source) == 2 and all(isinstance(d, int) for d in shape(traced.source)):
            return traced, index
    return None


def _projection(core: fx.Node):
    """x @ fn^T of a flattened [.., n, D] stream X: (X, n, fn's source, whether it is fn^T [nD, W],
    Contraction, the RMS statistic scaling x (HF's order) or None, the nodes between it and the
    GEMM). NoMatch(candidate=False) if `core` is no such projection."""
    weight = gemm_weight(core) if is_op(core, *GEMMS) else None
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
    x_operand = gemm_operands(core)[1 - index]
    for n in _streams_for(width):
        if K % n:
            continue
        def want(node, n=n):  # the [.., n, D] stream the flatten reads
            return rank(node) is not None and rank(node) >= 3 and shape(node)[-2:] == (n, K // n)

        x, scaled_by, scaled_path = trace(x_operand, want), None, []
        if x is None:  # HF's order: the projection reads x * r
            under = trace(x_operand)
            if under is not None and is_op(under.source, aten.mul):
                mul = under.source
                for a, b in (mul.args[:2], mul.args[1::-1]):
                    inner = trace(a, want) if isinstance(a, fx.Node) and isinstance(b, fx.Node) else None
                    if inner is not None and is_op(b, aten.rsqrt, aten.reciprocal, aten.mul):
                        axes = replay(under.path, inner.axes)
                        if axes is not None:
                            x, scaled_by, scaled_path = Traced(inner.source, axes, inner.path), b, under.path + [mul]
                        break
        if x is None:
            rounded = trace(x_operand, want, rounding=True)
            cast = [c for c in (rounded.path if rounded else []) if is_convert(c) and not widens(c)]
            if cast:  # e.g. an fp64 stream read as fp32: the kernel reads its stream dtype as it is
                names = [str(dtype(c)).removeprefix("torch.") for c in (cast[0].args[0], cast[0])]
                raise NoMatch(f"the fn projection reads a [.., {n}, {K // n}] stream rounded from {names[0]} to "
                              f"{names[1]}: the kernel reads fp32, bf16 or fp16 streams as they are")
            continue
        stream = x.source
        traced = {x_operand: x, gemm_operands(core)[index]: w}
        found = contract(core, trace=lambda o: traced[o])
        r = rank(stream)
        k_atoms = {(w.source, k_axis[0]), (stream, r - 2), (stream, r - 1)}
        if found is None or found.summed != [frozenset(k_atoms)] or atom_members(found.axes) != (
                leading_atoms(stream, 2) + [frozenset({(w.source, 1 - k_axis[0])})]):
            raise NoMatch("the fn projection does not contract the flattened stream's n*D values with fn's")
        return stream, n, w.source, transposed, found, scaled_by, scaled_path
    raise NoMatch("not a projection of a flattened [.., n, D] stream", candidate=False)


def unpad_projections(graph: fx.Graph) -> None:
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
            if not e.candidate:
                graph.erase_node(plain)
                continue
            # a projection whose seam does not fuse: its own match says why
        plain.meta["stack_trace"] = gemm.meta.get("stack_trace")
        end.replace_all_uses_with(plain)
        _erase_unused(end)


def _erase_unused(node: fx.Node) -> None:
    """Erase `node` and then each of its inputs that nothing else reads (the padded GEMM's slices,
    the GEMM, the padding): a reader left behind would count as a use of the stream outside the
    seam."""
    if node.users or node.op != "call_function":
        return
    inputs = [a for a in node.all_input_nodes]
    node.graph.erase_node(node)
    for a in inputs:
        _erase_unused(a)


def match_head(core: fx.Node) -> Head:
    """The fn projection `core` of an mHC site -> the whole coefficient head."""
    stream, n, fn_source, transposed, projection, scaled_by, scaled_path = _projection(core)
    width = val(fn_source).shape[1 if transposed else 0]
    if (2 + n) * n != width:
        raise NoMatch(f"a pre-only head (fn has n = {n} rows: V4's HyperHead), not an mHC site's (2+n)n")
    if transposed and fn_source.op != "get_attr":
        raise NoMatch("the fn projection reads a weight stored as fn^T [nD, (2+n)n]: not a supported layout")
    fn = frozen_weight(fn_source, width, transposed, "fn projection weight") if fn_source.op == "get_attr" else None
    fn = fn if fn is not None else unwiden(fn_source)
    top, axes, lifted = lift(core, projection.axes)
    nodes = projection.nodes + lifted + scaled_path
    r = rank(stream)
    flat = leading_atoms(stream, 2) + [frozenset({(stream, r - 2)}), frozenset({(stream, r - 1)})]
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
    stat = trace(stat_x, lambda node: node is stream)
    if stat is None or atom_members(stat.axes) != flat:
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
        base = unwiden(base)
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
    if len(comb_logits) != 1 or shape(comb_logits[0])[-2:] != (n, n):
        raise NoMatch("comb logits are not reshaped to [n, n]")
    comb, hc_eps, iters, sink_nodes = _sinkhorn(comb_logits[0])
    if pre_eps[1] != hc_eps:
        raise NoMatch(f"pre's eps differs from Sinkhorn's eps ({pre_eps[1]!r} against {hc_eps!r})")
    nodes += [sig_pre, pre, sig_post, post, comb_logits[0], comb_mix, *sink_nodes]
    return Head(stream, fn, base, scale, stat_eps, hc_eps, iters, pre, post, comb, list(dict.fromkeys(nodes)))


def head_readers(stream: fx.Node) -> list[fx.Node]:
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
            elif depth < 6 and (is_op(user, *LAYOUT, aten.mul) or widens(user)):
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
    add = stream.args[0] if is_convert(stream) and not widens(stream) else stream
    return add if is_op(add, aten.add) and all(isinstance(a, fx.Node) for a in add.args[:2]) else None


def match_post(stream: fx.Node) -> Post | None:
    """The post that makes `stream`; None if nothing post-like does (a first seam, an Engram
    injection), NoMatch if a post-like add is not the reference's post."""
    add = _post_add(stream)
    if add is None:
        return None
    sizes = shape(stream)
    lead, n, D = sizes[:-2], sizes[-2], sizes[-1]
    if n == D:
        return None  # comb [.., n, n] and X [.., n, D] cannot be told apart by their shapes
    # each operand read down to the lowest tensor of its shape (X, not the embedding a first stream
    # is expanded from)
    gate_want, mix_want = has_shape(lead + (n,), lead + (D,)), has_shape(lead + (n, n), lead + (n, D))
    for gate_top, mix_top in (add.args[:2], add.args[1::-1]):
        gate = contraction_at(gate_top, lambda o: trace(o, gate_want))
        mix = contraction_at(mix_top, lambda o: trace(o, mix_want))
        if gate is None or mix is None or gate.summed or not mix.summed:
            continue
        gate_src = {shape(t.source): t.source for t in gate.operands}
        mix_src = {shape(t.source): t.source for t in mix.operands}
        if set(gate_src) != {lead + (n,), lead + (D,)} or set(mix_src) != {lead + (n, n), lead + (n, D)}:
            continue
        post, y = gate_src[lead + (n,)], gate_src[lead + (D,)]
        comb, streams = mix_src[lead + (n, n)], mix_src[lead + (n, D)]
        computes = {dtype(x) for x in [add] + gate.nodes + mix.nodes if not is_op(x, *LAYOUT)}
        if computes != {F32}:
            wide = sorted(str(d).removeprefix("torch.") for d in computes - {F32})
            raise NoMatch(f"the post mixes in {', '.join(wide)} (HF's bf16 post rounds post and comb first), "
                          f"not in fp32 like the reference")
        r = len(sizes)
        if mix.summed == [frozenset({(comb, r - 1), (streams, r - 2)})]:
            raise NoMatch("the residual mix is C X (it sums over comb's second index), not C^T X")
        if mix.summed != [frozenset({(comb, r - 2), (streams, r - 2)})] or atom_members(mix.axes) != (
                leading_atoms(streams, 2, comb) + [frozenset({(comb, r - 1)}), frozenset({(streams, r - 1)})]):
            raise NoMatch("the residual mix is not C^T X (sum over comb's first index)")
        if atom_members(gate.axes) != leading_atoms(y, 1, post) + [frozenset({(post, r - 2)}), frozenset({(y, r - 2)})]:
            raise NoMatch("the post gate is not post[.., j] * y[.., d]")
        nodes = [add] + gate.nodes + mix.nodes + ([stream] if stream is not add else [])
        return Post(streams, y, post, comb, nodes)
    return None


# ---- the collapse and its norm ----------------------------------------------------------------

@dataclass
class Collapse:
    """c = (sum_k pre[k] X'[k]).to(dtype), u = RMSNorm(c): the pre it reads, the norm, u."""

    pre: fx.Node
    norm: Norm
    c: fx.Node  # the collapse as the norm reads it (rounded to the stream dtype)
    nodes: list[fx.Node]


@dataclass
class Norm:
    """u = RMSNorm(c) with weight w: u, how it is rounded (MhcSpec.norm_rounding), its nodes and
    the roundings among them (nodes in the stream dtype by design)."""

    weight: fx.Node
    eps: float
    u: fx.Node
    rounding: str
    roundings: list[fx.Node]
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


def _is_norm_weight(node, D: int) -> bool:
    return rank(node) == 1 and val(node).shape[0] == D


def _match_norm(c: fx.Node, stream: fx.Node) -> Norm:
    """u = (c * r * w).to(dtype), r = 1 / sqrt(mean(c^2) + eps), the product in any order
    (rounding "once"), or u = w * (c * r).to(dtype) with w in the stream dtype (rounding "twice",
    Llama-style RMSNorm)."""
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
        if unwiden(x) is not c:
            reasons.append("the norm's statistic does not read the collapse")
            continue
        for top in _users(r, aten.mul):
            for _ in range(3):  # up the product tree until it holds c, r and the weight
                leaves = _mul_leaves(top, r)
                xs = [leaf for leaf in leaves if unwiden(leaf) is c]
                ws = [leaf for leaf in leaves if leaf not in xs and leaf is not r and _is_norm_weight(leaf, D)]
                common = stat_nodes + [top] + _products(top, r) + widen_path(xs[0]) + widen_path(x) if xs else []
                if len(leaves) == 3 and r in leaves and len(xs) == 1 and len(ws) == 1:
                    out = [u for u in top.users if is_convert(u) and not widens(u)]
                    u = out[0] if out else top
                    _check_rounded(u, stream)
                    return Norm(unwiden(ws[0]), eps, u, "once", [u], common + out)
                twice = _weighted_after_rounding(top, stream, D) if len(leaves) == 2 and r in leaves and xs else None
                if twice is not None:
                    rounded, weight, u, nodes = twice
                    _check_rounded(u, stream)
                    return Norm(weight, eps, u, "twice", [rounded, u], common + nodes)
                if len(top.users) != 1 or not is_op(next(iter(top.users)), aten.mul):
                    break
                top = next(iter(top.users))
        reasons.append("the norm is not c * r * weight")
    raise NoMatch("the collapse is not normalised by an RMSNorm over the last dim"
                  + (f" ({', '.join(dict.fromkeys(reasons))})" if reasons else ""))


def _weighted_after_rounding(normalised: fx.Node, stream: fx.Node, D: int):
    """(rounded, w, u, nodes) where u = (w * normalised.to(stream dtype)).to(stream dtype), w [D]:
    Llama-style RMSNorm's `weight * x.to(input_dtype)` (with an fp32 weight the product is fp32
    and the model rounds it after). None where the graph is not that."""
    rounded = sole_user(normalised)
    if rounded is None or not is_convert(rounded) or widens(rounded) or dtype(rounded) != dtype(stream):
        return None
    read, nodes = rounded, [rounded]
    while widens(sole_user(read)):  # rounded, then widened for an fp32 weight
        read = sole_user(read)
        nodes.append(read)
    u = sole_user(read)
    if u is None or not is_op(u, aten.mul) or read not in u.args[:2]:
        return None
    weight = u.args[1] if u.args[0] is read else u.args[0]
    if not isinstance(weight, fx.Node) or not _is_norm_weight(weight, D):
        return None
    nodes.append(u)
    out = sole_user(u)
    if dtype(u) != dtype(stream) and out is not None and is_convert(out) and not widens(out):
        u = out
        nodes.append(u)
    return rounded, unwiden(weight), u, nodes


def _check_rounded(u: fx.Node, stream: fx.Node) -> None:
    if dtype(u) != dtype(stream):
        raise NoMatch(f"the norm's output stays {str(dtype(u)).removeprefix('torch.')}, not rounded to the stream dtype")


def _products(node: fx.Node, keep: fx.Node) -> list[fx.Node]:
    """The products _mul_leaves opened."""
    out = []
    for a in node.args[:2]:
        if is_op(a, aten.mul) and a is not keep and len(a.users) == 1:
            out += [a] + _products(a, keep)
    return out


def collapse_cores(stream: fx.Node) -> list[fx.Node]:
    """Products summed, and bmms, that read `stream` through views and exact converts."""
    found, frontier, seen = [], [stream], set()
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if is_op(user, *LAYOUT) or widens(user):
                frontier.append(user)
            elif is_op(user, aten.mul):
                found += _users(user, aten.sum)
            elif is_op(user, aten.bmm):
                found.append(user)
    return found


def match_collapse(stream: fx.Node, whose: str) -> Collapse:
    """The hc_pre + RMSNorm reading `stream` (`whose` stream: for the reason), or NoMatch saying
    what is missing."""
    sizes = shape(stream)
    lead, n = sizes[:-2], sizes[-2]
    r = len(sizes)
    want = lambda node: node is stream or shape(node) == lead + (n,)  # noqa: E731
    reasons = []
    for core in collapse_cores(stream):
        found = contract(core, lambda o: trace(o, want))
        if found is None or stream not in [t.source for t in found.operands]:
            continue
        pre = next((t.source for t in found.operands if t.source is not stream), None)
        if pre is None or shape(pre) != lead + (n,):
            continue
        top, axes, lifted = lift(core, found.axes)
        if found.summed != [frozenset({(pre, r - 2), (stream, r - 2)})] or atom_members(axes) != (
                leading_atoms(stream, 2, pre) + [frozenset({(stream, r - 1)})]):
            reasons.append("the product of pre and X' is not summed over the streams")
            continue
        rounded = [u for u in top.users if is_convert(u) and dtype(u) == dtype(stream) and not widens(u)]
        c = rounded[0] if rounded else top  # (torch 2.11 folds c's round trip when only the norm reads it)
        try:
            norm = _match_norm(c, stream)
        except NoMatch as e:
            reasons.append(e.reason)
            continue
        return Collapse(pre, norm, c, found.nodes + lifted + rounded + norm.nodes)
    raise NoMatch(f"no hc_pre + RMSNorm reads {whose}" + (f": {'; '.join(dict.fromkeys(reasons))}" if reasons else ""))
