"""Mega-mHC: the mHC seam between two sublayers -> one generated Triton kernel.

Pattern (post-grad ATen graph), anchored at the coefficient head of a site, or at a final collapse:

    X' = hc_post(y, X, post, comb)   = (post[j] y + sum_i comb[i,j] X[i]).to(stream dtype)     optional
    x  = flatten(X').float();   r = rsqrt(mean(x^2) + eps)
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
stream dtype exactly where the reference does; Sinkhorn runs the same number of rounds.

The mixing term's transpose is checked, not assumed: the matcher follows the comb operand through
unsqueeze/permute/reshape to the batched GEMM and accepts only `sum over the first index`.

Inductor's freezing (`torch._inductor.config.freezing`) makes the weights constants (get_attr
nodes) and folds whatever reads only them: fn^T becomes one constant (or, on CPU with weight
prepacking, the projection becomes MKL's linear, which keeps fn as its third argument), base's
split becomes three constants and scale's selects three scalars. The head matcher accepts those and
rebuilds fn, base and scale as the kernel reads them, as new constants of the GraphModule, once at
compile time (frozen weights do not change).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from lowering import mega_mhc as mhc_kernels

from .ops import mhc_fake, mhc_unsupported
from .base import Candidate, FusionPass, NoMatch
from .graph import (MKL_LINEAR, aten, dtype, frozen_value, is_convert, is_last_dim, is_op, linear_operands,
                    linear_weight, new_constant, only_users_in, prims, rank, scalar, strip, val)
from .registry import register

LAYOUT = (aten.view, aten._unsafe_view, aten.reshape, aten.unsqueeze, aten.squeeze, aten.permute,
          aten.expand, aten.clone, aten.transpose, aten.t)


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


# ---- small recognisers ------------------------------------------------------------------------

def _stream_under(node, n: int, dim: int) -> tuple[fx.Node, list[fx.Node]]:
    """The [.., n, D] stream a statistic reads: strip views and fp32 upcasts down to the first
    tensor of that shape, but never through a downcast (rounding X' to the stream dtype belongs to
    the post, and X' is the rounded tensor) nor into what built the stream (an expand, say)."""
    skipped = []
    while is_op(node, *LAYOUT) or (is_convert(node) and dtype(node) == torch.float32):
        if rank(node) is not None and rank(node) >= 3 and tuple(val(node).shape[-2:]) == (n, dim) and not is_convert(node):
            break
        skipped.append(node)
        node = node.args[0]
    return node, skipped


def _reads(node, target) -> bool:
    """node is `target` seen through layout ops and dtype converts."""
    while node is not target and (is_op(node, *LAYOUT) or is_convert(node)):
        node = node.args[0]
    return node is target


def _rms_stat(node) -> tuple[fx.Node, float, list[fx.Node]]:
    """rsqrt(mean(x^2, -1, keepdim) + eps) -> (x, eps, nodes)."""
    if not is_op(node, aten.rsqrt) or not is_op(node.args[0], aten.add):
        raise NoMatch("no rsqrt(mean(x^2) + eps) statistic")
    add = node.args[0]
    eps = scalar(add.args[1])
    mean = add.args[0]
    if eps is None or not is_op(mean, aten.mean) or not is_op(mean.args[0], aten.pow) or scalar(mean.args[0].args[1]) != 2:
        raise NoMatch("no rsqrt(mean(x^2) + eps) statistic")
    return mean.args[0].args[0], eps, [node, add, mean, mean.args[0]]


def _mul_operands(node) -> tuple:
    return tuple(node.args[:2]) if is_op(node, aten.mul) else ()


def _affine(node, mix_part, base_part, scale_index):
    """m * scale[i] + base_part, in either operand order -> nodes, or NoMatch."""
    if not is_op(node, aten.add):
        raise NoMatch("coefficient affine map not found")
    a, b = node.args
    mul, base = (a, b) if is_op(a, aten.mul) else (b, a)
    if _through_layout(base) is not base_part or not is_op(mul, aten.mul):
        raise NoMatch("coefficient affine map not found")
    m, s = mul.args if _through_layout(mul.args[0]) is mix_part else mul.args[::-1]
    if _through_layout(m) is not mix_part:
        raise NoMatch("coefficient affine map does not read the mix")
    views = [x for x in (m, base) if x is not mix_part and x is not base_part]  # e.g. HF's [n, n] views
    if is_op(s, aten.select) and s.args[1] == 0 and s.args[2] == scale_index:  # scale[i]
        return [node, mul, s, *views], s.args[0]
    if s.target is operator.getitem and is_op(s.args[0], aten.unbind) and s.args[1] == scale_index:  # scale.unbind(0)[i]
        return [node, mul, s, s.args[0], *views], s.args[0].args[0]
    if s.op == "get_attr":  # a frozen scale[i]: Inductor's freezing folded the select into a constant
        return [node, mul, *views], s
    raise NoMatch("coefficient affine map does not read scale[%d]" % scale_index)


def _only_user(node, *packets):
    users = [u for u in node.users if is_op(u, *packets)]
    if len(users) != 1:
        raise NoMatch(f"{node.name}: expected one {packets[0]} user")
    return users[0]


def _softmax(start: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """softmax over the last dim of `start`, in either of the forms Inductor decomposes it to:
    amax, sub, exp, sum, div; or, where its online-softmax rewrite runs (Triton on CUDA),
    prims.prepare_softmax_online -> (max, sum), sub, exp, div."""
    online = [u for u in start.users if is_op(u, prims.prepare_softmax_online)]
    if not online:
        amax = _only_user(start, aten.amax)
        sub = _only_user(amax, aten.sub)
        exp = _only_user(sub, aten.exp)
        total = _only_user(exp, aten.sum)
        soft = _only_user(total, aten.div)
        return soft, [amax, sub, exp, total, soft]
    if len(online) != 1 or not is_last_dim(online[0].args[1], start):
        raise NoMatch(f"{start.name}: expected one online softmax over the last dim")
    prepare = online[0]
    items = {u.args[1]: u for u in prepare.users if u.target is operator.getitem}
    if set(items) != {0, 1}:
        raise NoMatch(f"{prepare.name}: the online softmax's max and sum are not both used")
    sub = _only_user(items[0], aten.sub)
    exp = _only_user(sub, aten.exp)
    soft = _only_user(exp, aten.div)
    if sub.args[0] is not start or soft.args[1] is not items[1]:
        raise NoMatch(f"{prepare.name}: not exp(x - max) / sum")
    return soft, [prepare, items[0], items[1], sub, exp, soft]


def _sinkhorn(start: fx.Node) -> tuple[fx.Node, float, int, list[fx.Node]]:
    """softmax(-1) + eps, then alternating column / row divisions by (sum + eps), ending on columns."""
    soft, nodes = _softmax(start)
    plus = _only_user(soft, aten.add)
    eps = scalar(plus.args[1])
    nodes.append(plus)
    current, normalisations, expect = plus, 0, -2
    while True:
        sums = [u for u in current.users if is_op(u, aten.sum) and list(u.args[1]) == [expect]]
        if len(sums) != 1:
            break
        s = sums[0]
        add = _only_user(s, aten.add)
        div = [u for u in add.users if is_op(u, aten.div) and u.args[0] is current]
        if scalar(add.args[1]) != eps or len(div) != 1:
            break
        nodes += [s, add, div[0]]
        current, normalisations, expect = div[0], normalisations + 1, -1 if expect == -2 else -2
    if normalisations % 2 == 0:
        raise NoMatch("Sinkhorn does not end on a column normalisation")
    return current, eps, (normalisations + 1) // 2, nodes


def _frozen_concat(graph: fx.Graph, parts: list[fx.Node], name: str) -> fx.Node:
    """base [(2+n)n] or scale [3] from the constants freezing folded their slices into (each
    base_pre / base_post / base_comb, each scale[i])."""
    values = [frozen_value(p) for p in parts]
    if any(v is None for v in values):
        raise NoMatch(f"the coefficient {name} is frozen in part only")
    if len({v.dtype for v in values}) != 1:
        raise NoMatch(f"the frozen pieces of the coefficient {name} differ in dtype")
    return new_constant(graph, parts[-1], name, torch.cat([v.reshape(-1) for v in values]))


def _match_head(split: fx.Node) -> Head:
    """split(mix, [n, n, n*n]) of an mHC projection -> the whole coefficient head."""
    sizes = list(split.args[1])
    if len(sizes) != 3 or sizes[0] != sizes[1] or sizes[2] != sizes[0] ** 2:
        raise NoMatch("not an [n, n, n*n] coefficient split", candidate=False)
    n = sizes[0]
    mix = split.args[0]
    # (x @ fn^T) * r   or   (x * r) @ fn^T
    mm, rsqrt = None, None
    if is_op(mix, aten.mul):
        a, b = mix.args
        a_core, b_core = strip(a, converts=False)[0], strip(b, converts=False)[0]
        mm, rsqrt = (a_core, b) if is_op(a_core, aten.mm, *MKL_LINEAR) else (b_core, a)
        nodes_mm_views = strip(a if mm is a_core else b, converts=False)[1]
    else:
        mm, nodes_mm_views = strip(mix, converts=False)
    linear = linear_operands(mm, "fn projection")
    if linear is None:
        raise NoMatch("the coefficient mix is not an fn projection (mm)", candidate=False)
    x, fn_t, transposed = linear
    found = linear_weight(fn_t, sum(sizes), transposed, "fn projection weight")
    if found is None:
        raise NoMatch("the fn projection's weight is neither fn^T [nD, (2+n)n] nor a frozen constant")
    fn = found[0]
    nodes = [split, mix, mm, fn_t, *nodes_mm_views]
    if rsqrt is None:  # HF order: the projection reads x * r
        x_view, skipped = strip(x, converts=False)
        x_norm = x_view
        operands = _mul_operands(x_norm)
        rs = [o for o in operands if is_op(o, aten.rsqrt)]
        if not rs:
            raise NoMatch("no RMS statistic scales the fn projection")
        x_flat = operands[0] if operands[1] is rs[0] else operands[1]
        stat_x, stat_eps, stat_nodes = _rms_stat(rs[0])
        nodes += skipped + [x_norm, *stat_nodes]
        rs_cast = []
    else:
        rs_src, rs_cast = strip(rsqrt, layout=False)
        stat_x, stat_eps, stat_nodes = _rms_stat(rs_src)
        x_flat = x
        nodes += rs_cast + stat_nodes
    stream, flatten_nodes = _stream_under(x_flat, n, val(fn).shape[-1] // n)
    if not _reads(stat_x, stream):
        raise NoMatch("the RMS statistic and the fn projection read different tensors")
    nodes += flatten_nodes
    if rank(stream) is None or rank(stream) < 3 or val(stream).shape[-2] != n:
        raise NoMatch(f"the projection does not read an [.., {n}, D] residual stream")

    getitems = {u.args[1]: u for u in split.users if u.target is operator.getitem}
    if len(getitems) != 3:
        raise NoMatch("coefficient split outputs are not all used")
    # base is split the same way: find it through the affine maps
    m_pre, m_post, m_comb = getitems[0], getitems[1], getitems[2]
    add_pre = _only_user(_only_user(m_pre, aten.mul), aten.add)
    add_post = _only_user(_only_user(m_post, aten.mul), aten.add)
    comb_mix = m_comb if any(is_op(u, aten.mul) for u in m_comb.users) else _only_user(m_comb, aten.view, aten.reshape)
    add_comb = _only_user(_only_user(comb_mix, aten.mul), aten.add)
    base_pre = next(a for a in add_pre.args if not is_op(a, aten.mul))
    frozen = base_pre.op == "get_attr"  # Inductor's freezing folded base's split into constants
    if frozen:
        base_items = {i: next(a for a in add.args if not is_op(a, aten.mul))
                      for i, add in enumerate((add_pre, add_post, add_comb))}
        base_split = None
    elif base_pre.target is operator.getitem and is_op(base_pre.args[0], aten.split_with_sizes, aten.split):
        base_split = base_pre.args[0]
        base_items = {u.args[1]: u for u in base_split.users if u.target is operator.getitem}
        base = base_split.args[0]
    else:
        raise NoMatch("the coefficient base is not split like the mix")
    a_pre, scale = _affine(add_pre, m_pre, base_items[0], 0)
    a_post, scale_post = _affine(add_post, m_post, base_items[1], 1)
    a_comb, scale_comb = _affine(add_comb, m_comb, base_items[2], 2)
    if frozen:  # one base and one scale, as the kernel reads them, from the folded pieces
        base = _frozen_concat(split.graph, [base_items[i] for i in range(3)], "base")
        scale = _frozen_concat(split.graph, [scale, scale_post, scale_comb], "scale")
    # pre = sigmoid(.) + hc_eps; post = 2 * sigmoid(.)
    sig_pre = _only_user(add_pre, aten.sigmoid)
    pre = _only_user(sig_pre, aten.add)
    sig_post = _only_user(add_post, aten.sigmoid)
    post = _only_user(sig_post, aten.mul)
    if scalar(post.args[1]) != 2.0:
        raise NoMatch("post gate is not 2 * sigmoid")
    # [n, n] either before the affine map (HF) or after it (ours)
    comb_logits = ([add_comb] if rank(add_comb) == rank(m_comb) + 1 else
                   [u for u in add_comb.users if is_op(u, aten.view, aten.reshape, aten._unsafe_view)])
    if len(comb_logits) != 1:
        raise NoMatch("comb logits are not reshaped to [n, n]")
    comb, hc_eps, iters, sink_nodes = _sinkhorn(comb_logits[0])
    if scalar(pre.args[1]) != hc_eps:
        raise NoMatch("pre's eps differs from Sinkhorn's eps")
    nodes += [m_pre, m_post, m_comb, *([base_split] if base_split is not None else []), *base_items.values(),
              *a_pre, *a_post, *a_comb,
              sig_pre, pre, sig_post, post, comb_logits[0], comb_mix, *sink_nodes]
    return Head(stream, fn, base, scale, stat_eps, hc_eps, iters, pre, post, comb, nodes)


def _labels_through(node: fx.Node, source: fx.Node, labels: tuple) -> tuple | None:
    """Axis labels of `node` if it is `source` reshaped only by unsqueeze/permute/size-1 reshapes."""
    chain = []
    while node is not source:
        if not is_op(node, *LAYOUT) and not is_convert(node):
            return None
        chain.append(node)
        node = node.args[0]
    for op in reversed(chain):
        shape = list(val(op).shape)
        if is_op(op, aten.unsqueeze):
            d = op.args[1] % (len(labels) + 1)
            labels = labels[:d] + ("1",) + labels[d:]
        elif is_op(op, aten.permute):
            labels = tuple(labels[i] for i in op.args[1])
        elif is_op(op, aten.transpose):
            a, b = (d % len(labels) for d in op.args[1:3])
            lst = list(labels)
            lst[a], lst[b] = lst[b], lst[a]
            labels = tuple(lst)
        elif is_op(op, aten.view, aten.reshape, aten._unsafe_view, aten.squeeze, aten.expand, aten.clone) or is_convert(op):
            in_shape = list(val(op.args[0]).shape)
            real = [lab for lab, size in zip(labels, in_shape) if size != 1]  # size-1 axes carry nothing
            kept = [s for s in shape if s != 1]
            while len(real) > len(kept) and len(real) >= 2 and real[0].startswith("b") and real[1].startswith("b"):
                real = ["b"] + real[2:]  # leading batch axes merged into one (a bmm's batch)
            if len(real) != len(kept):
                return None  # merges or splits the mixed axes: not a pure relabelling
            it = iter(real)
            labels = tuple("1" if s == 1 else next(it) for s in shape)
    return labels


def _through_layout(node) -> fx.Node:
    """The tensor under any stack of layout ops (views, permutes, unsqueezes) and converts."""
    while is_op(node, *LAYOUT) or is_convert(node):
        node = node.args[0]
    return node


def _stream_operand(node, stream: fx.Node) -> fx.Node:
    """The residual stream a post mixes, seen through the layout ops and upcast of its operand:
    the first tensor on that path with the stream's rank, [.., n, D] tail and dtype. Going to the
    bottom instead would follow a first-layer stream back into the embedding it was expanded from
    (and pull the stream's own clone, which other readers share, into the chain)."""
    while True:
        v = val(node)
        if (rank(node) == rank(stream) and tuple(v.shape[-2:]) == tuple(val(stream).shape[-2:])
                and v.dtype == val(stream).dtype):
            return node
        if not (is_op(node, *LAYOUT) or is_convert(node)):
            return node
        node = node.args[0]


def _match_post(stream: fx.Node):
    """X' = (post[j] y + sum_i comb[i,j] X[i]).to(dtype) -> (X, y, post, comb, nodes) or None."""
    add, casts = strip(stream, layout=False)
    if not is_op(add, aten.add):
        return None
    for gate, mixed in (add.args, add.args[::-1]):
        if not is_op(gate, aten.mul):
            continue
        mixed_core = _through_layout(mixed)
        if not is_op(mixed_core, aten.bmm):
            continue
        lhs, rhs = mixed_core.args
        a, b = (_through_layout(x) for x in gate.args)
        # post is [.., n] (one rank below the stream), y is [.., D]
        post, y = (a, b) if val(a).shape[-1] == val(stream).shape[-2] and rank(a) == rank(stream) - 1 else (b, a)
        comb, streams = _through_layout(lhs), _stream_operand(rhs, stream)
        if rank(comb) != rank(stream) or rank(streams) != rank(stream):
            continue
        lead = tuple(f"b{i}" for i in range(rank(comb) - 2))
        comb_labels = _labels_through(lhs, comb, lead + ("i", "j"))
        x_labels = _labels_through(rhs, streams, lead + ("i", "d"))
        if comb_labels is None or x_labels is None:
            continue
        core = lambda labels: tuple(lab for lab in labels if lab != "1")  # noqa: E731
        # bmm contracts lhs's last axis with rhs's middle axis: we need lhs = (.., j, i), rhs = (.., i, d)
        if core(comb_labels)[-2:] != ("j", "i") or core(x_labels)[-2:] != ("i", "d"):
            raise NoMatch("the residual mix is not C^T X (sum over comb's first index)")
        nodes = [stream, *casts, add, gate, mixed_core]
        for side in (*gate.args, mixed, lhs, rhs):
            node = side
            while node not in (post, y, comb, streams, mixed_core):
                nodes.append(node)
                node = node.args[0]
        return streams, y, post, comb, nodes
    return None


def _match_collapse(stream: fx.Node):
    """The hc_pre + RMSNorm reading `stream`: (pre, norm_weight, norm_eps, u, nodes) or None."""
    for user in list(stream.users) + [u for c in stream.users if is_convert(c) for u in c.users]:
        if not is_op(user, aten.mul):
            continue
        other = user.args[0] if _reads(user.args[1], stream) else user.args[1]
        if _reads(other, stream) or not _reads(user.args[0] if other is user.args[1] else user.args[1], stream):
            continue
        total = [s for s in user.users if is_op(s, aten.sum) and list(s.args[1]) in ([-2], [rank(user) - 2])]
        if len(total) != 1:
            continue
        collapsed = total[0]
        cast = [c for c in collapsed.users if is_convert(c)]
        c_node = cast[0] if cast else collapsed
        nodes = [user, collapsed] + cast + ([other] if is_op(other, aten.unsqueeze) else [])
        pre = other.args[0] if is_op(other, aten.unsqueeze) else other
        # RMSNorm: (x_f32 * rsqrt(mean(x_f32^2) + eps) * w).to(dtype), either multiplication order
        x32 = [c for c in c_node.users if is_convert(c)] or [c_node]
        for start in x32:
            rs = [u for u in start.users if is_op(u, aten.pow)]
            if not rs:
                continue
            try:
                mean = _only_user(rs[0], aten.mean)
                add = _only_user(mean, aten.add)
                rsq = _only_user(add, aten.rsqrt)
            except NoMatch:
                continue
            normed = [u for u in rsq.users if is_op(u, aten.mul) and start in u.args]
            if len(normed) != 1:
                continue
            scaled = [u for u in normed[0].users if is_op(u, aten.mul)]
            if len(scaled) != 1:
                continue
            weight = scaled[0].args[1] if scaled[0].args[0] is normed[0] else scaled[0].args[0]
            out = [c for c in scaled[0].users if is_convert(c)]
            u_node = out[0] if out else scaled[0]
            nodes += ([start] if start is not c_node else []) + [rs[0], mean, add, rsq, normed[0], scaled[0]] + out
            return pre, strip(weight, layout=False)[0], scalar(add.args[1]), u_node, nodes
    return None


def _kernel_spec(candidate: Candidate) -> mhc_kernels.MhcSpec:
    return mhc_kernels.MhcSpec(**{k: v for k, v in candidate.spec.items() if k != "left_unfused"})


def _op_args(candidate: Candidate) -> tuple:
    """megafuse::mega_mhc's arguments for a candidate (graph nodes and the spec's scalars)."""
    s, i = candidate.spec, candidate.inputs
    return (i["streams"], i["y"], i["post"], i["comb"], i["carried_pre"], i["fn"], i["base"], i["scale"],
            i["norm_weight"], s["sinkhorn_iters"], s["hc_eps"], s["stat_eps"], s["norm_eps"], s["has_post"],
            s["has_coefficients"], s["pre"], i.get("fn_pieces"))


@register
class MegaMhcPass(FusionPass):
    name = "mega_mhc"
    description = "mHC seam: previous post + coefficients (RMS, fn GEMM, sigmoid, Sinkhorn) + pre + RMSNorm in one kernel"
    op = "megafuse::mega_mhc"
    run_order = 10  # ARCHITECTURE.md: mhc, then gate

    def anchors(self, graph: fx.Graph):
        heads = [n for n in graph.nodes if is_op(n, aten.split_with_sizes, aten.split) and n.args
                 and isinstance(n.args[1], (list, tuple)) and len(n.args[1]) == 3 and is_op(n.args[0], aten.mul, aten.mm, aten.view, aten.reshape)]
        # final collapses: a post whose stream feeds a collapse + norm but no coefficient head
        finals = [n for n in graph.nodes if is_op(n, aten.bmm)]
        return heads + finals

    def match(self, anchor: fx.Node) -> Candidate:
        if is_op(anchor, aten.bmm):
            return self._match_final(anchor)
        head = _match_head(anchor)
        stream = head.stream
        collapse = _match_collapse(stream)
        if collapse is None:
            raise NoMatch("no hc_pre + RMSNorm reads the stream of this coefficient head")
        pre_src, norm_weight, norm_eps, u, collapse_nodes = collapse
        pre_mode = "fresh" if pre_src is head.pre else "carried"
        post = _match_post(stream)
        notes = []
        if post is None:
            notes.append("the stream does not come straight from a post (first seam or an Engram injection "
                         "between): any previous post stays unfused")
        return self._candidate(anchor, stream, post, head, pre_src, pre_mode, norm_weight, norm_eps, u,
                               collapse_nodes, notes)

    def _match_final(self, bmm: fx.Node) -> Candidate:
        # the bmm of a post: walk up to the post's output stream, then require a collapse + norm and
        # no coefficient head reading the stream (that case is matched from the head instead)
        node = bmm
        for _ in range(8):
            users = list(node.users)
            if len(users) != 1:
                break
            node = users[0]
            if is_op(node, aten.add):
                break
        if not is_op(node, aten.add):
            raise NoMatch("not a post", candidate=False)
        casts = [c for c in node.users if is_convert(c)]
        stream = casts[0] if casts else node
        post = _match_post(stream)
        if post is None:
            raise NoMatch("not an mHC post", candidate=False)
        readers = [u for u in stream.users if is_op(u, aten.view, aten.reshape, aten._unsafe_view) or is_convert(u)]
        if any(is_op(x, aten.pow, aten.mm) for r in readers for x in r.users):
            raise NoMatch("a coefficient head reads this stream (matched as a seam)", candidate=False)
        collapse = _match_collapse(stream)
        if collapse is None:
            raise NoMatch("the post's stream is not collapsed and normalised here", candidate=False)
        pre_src, norm_weight, norm_eps, u, collapse_nodes = collapse
        return self._candidate(bmm, stream, post, None, pre_src, "carried", norm_weight, norm_eps, u,
                               collapse_nodes, [])

    def _candidate(self, anchor, stream, post, head, pre_src, pre_mode, norm_weight, norm_eps, u,
                   collapse_nodes, notes) -> Candidate:
        nodes = list(collapse_nodes)
        if post is not None:
            nodes += post[4]
        if head is not None:
            nodes += head.nodes
        streams_in = post[0] if post is not None else stream
        n, dim = val(stream).shape[-2], val(stream).shape[-1]
        outputs = {"u": u}
        if post is not None:
            outputs["stream"] = stream
        if head is not None:
            outputs.update(pre=head.pre, post=head.post, comb=head.comb)
        inside = set(nodes)
        for node in nodes:
            if node not in outputs.values() and not only_users_in(node, inside):
                raise NoMatch(f"intermediate {node.name} is also used outside the mHC seam")
        spec = {
            "n": int(n), "dim": int(dim),
            "sinkhorn_iters": head.iters if head else 0, "hc_eps": head.hc_eps if head else 0.0,
            "stat_eps": head.stat_eps if head else 0.0, "norm_eps": norm_eps,
            "has_post": post is not None, "has_coefficients": head is not None, "pre": pre_mode,
            "stream_dtype": str(dtype(stream)).removeprefix("torch."),
        }
        inputs = {
            "streams": streams_in, "y": post[1] if post else None, "post": post[2] if post else None,
            "comb": post[3] if post else None, "carried_pre": pre_src if pre_mode == "carried" else None,
            "fn": head.fn if head else None, "base": head.base if head else None,
            "scale": head.scale if head else None, "norm_weight": norm_weight,
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
            raise NoMatch(f"the seam's inputs {cyclic} are computed from the seam itself")
        return Candidate(anchor, chain, spec | ({"left_unfused": notes} if notes else {}),
                         inputs=inputs, outputs=outputs, insert_before=graph_nodes[last_input + 1])

    def check(self, candidate: Candidate) -> str | None:
        reason = mhc_kernels.unsupported_reason(_kernel_spec(candidate))
        if reason is None:
            # The launch's own input checks, on the fake tensors. E.g. a bf16 model's last post: when
            # only the final collapse reads X', Inductor drops X''s rounding to bf16 (it removes
            # convert pairs), so the seam has fp32 streams but a bf16 y, which the kernel does not take.
            reason = mhc_unsupported(*(val(a) if isinstance(a, fx.Node) else a for a in _op_args(candidate)))
        return reason

    def rewrite(self, graph: fx.Graph, candidate: Candidate) -> fx.Node:
        outs = candidate.outputs
        fn = frozen_value(candidate.inputs["fn"])
        spec = _kernel_spec(candidate)
        if fn is not None and mhc_kernels.projects_bf16_pieces(spec):
            # a frozen fn does not change: its bf16 pieces are made here, once, so that the kernel
            # loads them instead of splitting fn in every token tile (LaunchConfig.presplit_fn)
            candidate.inputs["fn_pieces"] = new_constant(graph, candidate.inputs["fn"], "fn_pieces",
                                                         mhc_kernels.split_fn(fn, spec))
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
        return fused
