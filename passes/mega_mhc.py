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
the collapse) is read as what it does to the axes of the tensors it reads (`mhc_axes.contract`):
each axis of a result is a list of *atoms*, the source axes it runs over, and a GEMM or a broadcast
product pairs atoms and sums some away. So an einsum, `comb.mT @ X`, a bmm of flattened batches or a
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

Modules: passes/mhc_axes.py reads views, GEMMs and products as contractions over atoms;
passes/mhc_match.py matches the seam's pieces (the coefficient head with its Sinkhorn, the post,
the collapse and its norm); this module composes them into one candidate, checks and rewrites it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._inductor.pattern_matcher import stable_topological_sort

from megafuse.lowering import mega_mhc as mhc_kernels

from .base import Candidate, FusionPass, NoMatch
from .graph import aten, dtype, frozen_value, is_convert, is_op, new_constant, only_users_in, prims, rank, val
from .mhc_axes import GEMMS, LAYOUT, widens
from .mhc_match import (F32, collapse_cores, gemm_weight, head_readers, match_collapse, match_head, match_post,
                        unpad_projections)
from .ops import mhc_fake, mhc_scalars, mhc_unsupported
from .registry import register

# Ops that read parts of a tensor (base's three parts, scale[i]): like LAYOUT, they compute nothing.
INDEXING = (aten.split_with_sizes, aten.split, aten.slice, aten.select, aten.unbind)
# The kernel reads these inputs in fp32; a bf16 / fp16 one is widened by the rewrite (exact).
FP32_INPUTS = ("post", "comb", "carried_pre", "fn", "base", "scale", "norm_weight")
OUTPUT_NAMES = ("stream", "u", "pre", "post", "comb")  # megafuse::mega_mhc's outputs, in order


def _fake_f32(node: fx.Node) -> torch.Tensor:
    """node's fake value widened to fp32 (what the rewrite's convert makes of it)."""
    with val(node).fake_mode:
        return val(node).float()


# ---- the pass --------------------------------------------------------------------------------

def _op_args(candidate: Candidate, inputs: dict | None = None) -> tuple:
    """megafuse::mega_mhc's arguments for a candidate (graph nodes, or `inputs`, and the spec's scalars)."""
    i = inputs or candidate.inputs
    return (i["streams"], i["y"], i["post"], i["comb"], i["carried_pre"], i["fn"], i["base"], i["scale"],
            i["norm_weight"], *mhc_scalars(candidate.spec), i.get("fn_pieces"))


def _output_dtype_mismatch(candidate: Candidate, fakes: dict) -> str | None:
    """Why the fused op's outputs cannot stand in for the chain's nodes, or None: each must have the
    dtype its readers get now (a graph that reads u unrounded in fp32, where the seam rounds it to
    the stream dtype, computes another function; replaced as it is, its readers would also get a
    dtype they were not compiled for)."""
    fused = mhc_fake(*_op_args(candidate, fakes))
    for index, name in enumerate(OUTPUT_NAMES):
        node = candidate.outputs.get(name)
        if node is not None and dtype(node) != fused[index].dtype:
            return (f"the graph reads the seam's {name} ({node.name}) in {str(dtype(node)).removeprefix('torch.')}, "
                    f"where the fused seam gives {str(fused[index].dtype).removeprefix('torch.')}")
    return None


def _widened(node: fx.Node | None) -> bool:
    """An fp32 kernel input the graph holds in bf16 / fp16: the rewrite widens it (exact)."""
    return isinstance(node, fx.Node) and dtype(node) in (torch.bfloat16, torch.float16)


def _is_mix(node: fx.Node) -> bool:
    """A post's residual mix could sit here: a bmm (an mm where Inductor drops a size-1 batch, as
    at T = 1), or a broadcast product summed over one axis."""
    if is_op(node, aten.mm, aten.bmm):
        return True
    return (is_op(node, aten.sum) and is_op(node.args[0], aten.mul) and rank(node.args[0]) is not None
            and rank(node.args[0]) >= 4 and len(node.args) > 1 and len(node.args[1]) == 1)


@register
class MegaMhcPass(FusionPass):
    name = "mega_mhc"
    description = "mHC seam: previous post + coefficients (RMS, fn GEMM, sigmoid, Sinkhorn) + pre + RMSNorm in one kernel"
    op = "megafuse::mega_mhc"
    run_order = 10  # the manager runs passes by ascending run_order: mhc, then gate, then attention

    def __init__(self, **options):
        super().__init__(**options)
        self._unfused_heads: dict[fx.Node, str] = {}

    def anchors(self, graph: fx.Graph):
        # every coefficient head first (a head's match takes its post along), then the posts whose
        # stream no matched head reads (final collapses, and seams whose head did not match)
        self._unfused_heads = {}  # fn projection -> why its seam did not fuse (a post's note says it)
        unpad_projections(graph)
        projections = [n for n in graph.nodes if is_op(n, *GEMMS) and gemm_weight(n) is not None]
        taken = set(projections)
        return projections + [n for n in graph.nodes if n not in taken and _is_mix(n)]

    def match(self, anchor: fx.Node) -> Candidate:
        if is_op(anchor, *GEMMS) and gemm_weight(anchor) is not None:
            try:
                return self._match_seam(anchor)
            except NoMatch as e:
                if e.candidate:
                    self._unfused_heads[anchor] = e.reason
                raise
        return self._match_final(anchor)

    def _match_seam(self, core: fx.Node) -> Candidate:
        head = match_head(core)
        collapse = match_collapse(head.stream, "the stream of this coefficient head")
        notes = []
        try:
            post = match_post(head.stream)
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
        rounded = [u for u in add[0].users if is_convert(u) and not widens(u)]
        stream = rounded[0] if len(rounded) == 1 else add[0]
        if rank(stream) is None or rank(stream) < 3 or not stream.users:
            raise NoMatch("not an mHC post", candidate=False)
        try:
            post = match_post(stream)
        except NoMatch as e:
            post_reason = e.reason
        else:
            if post is None:
                raise NoMatch("not an mHC post", candidate=False)
            post_reason = None
        heads = head_readers(stream)
        try:
            collapse = match_collapse(stream, "the post's stream")
        except NoMatch as e:
            if stream is not add[0] and not heads and collapse_cores(add[0]):
                # a collapse reads X' before its rounding: another function than the seam's (and the
                # graph torch 2.11's Inductor makes of a bf16 round trip: tests/passes/cuda_forms.py)
                raise NoMatch(f"the collapse reads X' unrounded ({str(dtype(add[0])).removeprefix('torch.')}), where "
                              f"the seam rounds X' to {str(dtype(stream)).removeprefix('torch.')} first") from None
            if heads or not collapse_cores(stream):  # (a seam: its head's anchor reports it)
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
        outputs = {"u": collapse.norm.u}
        if post is not None:
            outputs["stream"] = stream
        if head is not None:
            outputs.update(pre=head.pre, post=head.post, comb=head.comb)
        prefix = "; ".join(notes) + ", and " if partial else ""
        inside = set(nodes)
        for node in nodes:
            if node not in outputs.values() and not only_users_in(node, inside):
                raise NoMatch(f"{prefix}intermediate {node.name} is also used outside the mHC seam")
        # the reference computes every step in fp32 and rounds X', c and u only (u twice for a Llama-style norm)
        roundings = {stream, collapse.c, *collapse.norm.roundings}
        for node in nodes:
            reads = is_op(node, *LAYOUT, *INDEXING) or node.target is operator.getitem
            if node not in roundings and not reads and isinstance(val(node), torch.Tensor) and dtype(node) != F32:
                raise NoMatch(f"{prefix}{node.name} computes in {str(dtype(node)).removeprefix('torch.')}: the "
                              f"reference computes the seam in fp32 and rounds only X', the collapse and u")
        spec = mhc_kernels.MhcSpec(
            n=int(n), dim=int(dim), sinkhorn_iters=head.iters if head else 0, hc_eps=head.hc_eps if head else 0.0,
            stat_eps=head.stat_eps if head else 0.0, norm_eps=collapse.norm.eps, has_post=post is not None,
            has_coefficients=head is not None, pre=pre_mode, stream_dtype=str(dtype(stream)).removeprefix("torch."),
            norm_rounding=collapse.norm.rounding)
        inputs = {
            "streams": post.streams if post is not None else stream, "y": post.y if post else None,
            "post": post.post if post else None, "comb": post.comb if post else None,
            "carried_pre": collapse.pre if pre_mode == "carried" else None,
            "fn": head.fn if head else None, "base": head.base if head else None,
            "scale": head.scale if head else None, "norm_weight": collapse.norm.weight,
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
        return Candidate(anchor, chain, spec, inputs=inputs, outputs=outputs,
                         insert_before=graph_nodes[last_input + 1], left_unfused=notes)

    def check(self, candidate: Candidate) -> str | None:
        reason = mhc_kernels.unsupported_reason(candidate.spec)
        if reason is None:
            # The launch's own input checks, on the fake tensors as the rewrite passes them (with
            # bf16 / fp16 parameters widened). E.g. an fp32 stream with an fp64 y stays unfused.
            fakes = {k: (_fake_f32(a) if _widened(a) and k in FP32_INPUTS else val(a)) if isinstance(a, fx.Node)
                     else a for k, a in candidate.inputs.items()}
            reason = mhc_unsupported(*_op_args(candidate, fakes)) or _output_dtype_mismatch(candidate, fakes)
        if reason is not None and candidate.spec.has_coefficients:
            self._unfused_heads[candidate.anchor] = reason
        return reason

    def rewrite(self, graph: fx.Graph, candidate: Candidate) -> fx.Node:
        outs = candidate.outputs
        inputs = candidate.inputs
        fn = frozen_value(inputs["fn"])
        spec = candidate.spec
        with graph.inserting_before(candidate.insert_before):
            for name in FP32_INPUTS:
                if _widened(inputs[name]):  # a bf16 / fp16 parameter: exact in fp32, which the kernel reads
                    wide = graph.call_function(prims.convert_element_type.default, (inputs[name], F32))
                    wide.meta["val"] = _fake_f32(inputs[name])
                    inputs[name] = wide
        if fn is not None and mhc_kernels.projects_bf16_pieces(spec):
            # a frozen fn does not change: its bf16 pieces are made here, once, so that the kernel
            # loads them instead of splitting fn in every token tile (lowering.mega_mhc's PRESPLIT)
            inputs["fn_pieces"] = new_constant(graph, inputs["fn"], "fn_pieces",
                                               mhc_kernels.split_fn(fn.float(), spec))
        args = _op_args(candidate)
        with graph.inserting_before(candidate.insert_before):
            fused = graph.call_function(torch.ops.megafuse.mega_mhc.default, args)
            fused.meta["val"] = mhc_fake(*(val(a) if isinstance(a, fx.Node) else a for a in args))
            items = {}
            for index, name in enumerate(OUTPUT_NAMES):
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
