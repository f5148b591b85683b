"""Mega-Gate: the MoE router chain -> one generated Triton kernel.

Pattern (post-grad ATen graph, anchored at `aten.topk`), as a family:

    logits  = u @ W^T                 mm, bmm (einsum) or MKL's linear; u [..., D], W [E, D] (or stored [D, E])
    scores  = score(logits)           sigmoid | sqrt(softplus) | softmax over the experts, each as torch
                                      decomposes it or as written out: 1 / (1 + exp(-x)); where(x > 20, x,
                                      log1p(exp(x))); exp(x - max) / sum, or the online softmax of CUDA graphs
    choice  = scores [+ bias]         bias: one value per expert, selection only
    ids     = topk(choice, k, dim=-1)[1]
    w       = gather(scores, -1, ids)  or take_along_dim, scores[arange[:, None], ids], or (no bias) topk(...)[0]
    w       = w / (sum(w) [+ eps])     optional renormalisation (keepdim, or the sum unsqueezed)
    w       = w * scale                optional scale

Views, reshapes, permutes and dtype converts may sit anywhere along it: the pass follows them
(`walk`) and checks that they only move values (`in_order`, `source_dims`) or round them
(`_rounding`). On GPUs Inductor also zero-pads an unaligned GEMM's operands and slices its output
back (pad_mm), and unfuses addmm into mm + bias; tests/passes/cuda_forms.py reproduces both on CPU.

Replacement: `(w, ids) = megafuse::mega_gate(u, W, bias, *ops.GATE_SCALARS)`, whose reference is
`model.moe.route`; Inductor lowers it to the kernel `lowering.mega_gate` generates. u keeps its
leading dims ([B, S, D] routes to [B, S, k]); the weights come out fp32 and are cast to the chain's
dtype.

Why they are equal: the kernel computes the same logits, scores and biased choice, picks the k
largest by iterated arg-max (ties to the lowest index; `torch.topk` leaves tie order open) and
gathers the unbiased scores at the chosen ids, then renormalises and scales as the chain does.

Dtypes: torch runs a bf16 / fp16 op in fp32 and rounds its result, so a chain in a 16-bit dtype is
fp32 arithmetic rounded at known points. The pass reads them off the graph and binds them in the
spec: the GEMM inputs (a convert that widens is exact and is skipped: the kernel reads the narrow
tensor; one that narrows is reproduced by a convert of the input), the logits (the GEMM's output
dtype), each scoring op's result (`score_dtype`) and the choice (`choice_dtype`). Rounding the
same fp32 values at the same points selects the same experts. A chain that rounds where the kernel
cannot (a softmax or sigmoid written out op by op in bf16, softplus and its sqrt in different
dtypes, scores rounded to bf16 and then to fp16, the selection reading other scores than the
weights) stays unfused with the reason. The renormalisation runs in fp32 (a bf16 chain rounds it
at each step: equal within bf16 tolerance).

Inputs: the views and converts between u, W, bias and the chain are not part of it; they stay
where something else reads them. Every other node of the chain must be private to it.

Not this pattern (near misses, rejected with the reason): the bias also entering the weights
(gather from scores + bias), top-k over another dimension or of the smallest, top-k over raw
logits (e.g. a softmax applied after the top-k), weights gathered from another tensor, weights
divided by anything but their sum over the experts, a GEMM with a bias term, an offset that is not
one value per expert, intermediates used outside the chain, and selections that are not a top-k
at all (hash routing's table lookup has no top-k to anchor on).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from megafuse.lowering import mega_gate as gate_kernels

from . import ops
from .base import Candidate, FusionPass, NoMatch
from .graph import FLOATS, aten, arg, call, dims, dtype, frozen_value, frozen_weight, in_order, is_convert, is_last_dim, \
    is_op, linear_operands, per_row, prims, rank, reduction, scalar, source_dims, under_slices, unpadded, val, walk
from .registry import register

SOFTPLUS_THRESHOLD = 20.0  # torch's softplus default: x for x > 20

def _holds(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Every value of `narrow` is exact in `wide`."""
    return wide == narrow or (wide == torch.float32 and narrow in (torch.bfloat16, torch.float16))


def _rounding(path: list[fx.Node], what: str) -> torch.dtype:
    """The one dtype the values at the top of `path` are rounded to, from its source up: a convert
    that widens changes nothing, one that narrows rounds; bf16 then fp16 is not one rounding."""
    current = None
    for node in reversed(path):
        d = dtype(node)
        if d not in FLOATS:
            raise NoMatch(f"{what} in {d}: the kernel handles float32, bfloat16 and float16")  # float64, ints
        if current is None or _holds(current, d):  # the source, or a narrowing convert: rounds to d
            current = d
        elif not _holds(d, current):  # bf16 <-> fp16: each drops values of the other
            raise NoMatch(f"{what} are rounded to {_dtype_name(current)} and then to {_dtype_name(d)}: "
                          f"not one rounding the kernel reproduces")
        # else d widens exactly: the values keep current's precision
    return current


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


@dataclass
class _Input:
    """A tensor the kernel reads: `node`, transposed where the weight is stored [hidden, experts],
    rounded to `dtype` where the chain narrows it on the way to the GEMM or the bias add."""
    node: fx.Node
    dtype: torch.dtype
    transpose: bool = False

    def fake(self):
        v = val(self.node)
        return (v.t() if self.transpose else v).to(self.dtype)

    def materialise(self, graph: fx.Graph, weight_rows: int | None = None) -> fx.Node:
        """The node the fused op reads (a new transpose or convert where needed); `weight_rows`: E
        when this is the gate weight, whose frozen constant becomes a contiguous W once."""
        node = self.node
        if weight_rows is not None and frozen_value(node) is not None:
            node = frozen_weight(node, weight_rows, transposed=self.transpose, what="gate weight")
        elif self.transpose:
            node = call(graph, aten.permute.default, (node, [1, 0]), val(node).t())
        if dtype(node) != self.dtype:
            node = call(graph, prims.convert_element_type.default, (node, self.dtype), val(node).to(self.dtype))
        return node


def _pick_input(path: list[fx.Node], fits: list[fx.Node], what: str) -> _Input | None:
    """Which node of `path` (one of `fits`) the kernel reads: one whose values reach the chain
    unrounded, in the narrowest dtype (fewest bytes); else the highest, rounded as the chain does."""
    options = []
    for i, node in enumerate(path):
        try:
            options.append((node, _rounding(path[:i + 1], what)))
        except NoMatch:  # rounded twice on the way (bf16 W cast to fp16): read it after the second rounding
            continue
    options = [(node, r) for node, r in options if node in fits]
    unrounded = [(node, r) for node, r in options if dtype(node) == r]
    if unrounded:
        return _Input(*min(unrounded, key=lambda option: option[1].itemsize))
    return _Input(*options[0]) if options else None


# ---- the pieces of the chain ---------------------------------------------------------------------

def _computed_in_fp32(nodes: list[fx.Node], what: str) -> None:
    for node in nodes:
        if dtype(node) != torch.float32:
            raise NoMatch(f"{what} in {_dtype_name(dtype(node))} rounds after every step; the kernel rounds a score once "
                          f"(compute it in float32, or call the torch function)")


@dataclass
class _Scoring:
    func: str
    logits: fx.Node  # the value the scoring reads
    nodes: list[fx.Node]
    softplus_dtype: torch.dtype | None = None  # sqrt(softplus): what softplus rounds to before the sqrt


def _spelled_sigmoid(node: fx.Node) -> _Scoring | None:
    """[1 *] reciprocal(exp(-x) + 1): `1 / (1 + torch.exp(-x))` as torch traces it."""
    nodes = []
    if is_op(node, aten.mul) and scalar(node.args[1]) == 1.0:
        nodes.append(node)
        node = node.args[0]
    if not is_op(node, aten.reciprocal):
        return None
    den = node.args[0]
    if not (is_op(den, aten.add) and scalar(den.args[1]) == 1.0 and is_op(den.args[0], aten.exp)
            and is_op(den.args[0].args[0], aten.neg)):
        return None
    exp = den.args[0]
    nodes += [node, den, exp, exp.args[0]]
    _computed_in_fp32(nodes, "a sigmoid written out")
    return _Scoring("sigmoid", exp.args[0].args[0], nodes)


def _sqrt_softplus(sqrt: fx.Node) -> _Scoring:
    inner = [sqrt.args[0]]
    while is_convert(inner[-1]):
        inner.append(inner[-1].args[0])
    softplus = inner[-1]
    if is_op(softplus, aten.softplus):
        if scalar(arg(softplus, 1, "beta", 1)) != 1.0 or scalar(arg(softplus, 2, "threshold", 20)) != SOFTPLUS_THRESHOLD:
            raise NoMatch("softplus with beta != 1 or threshold != 20 is not a supported scoring variant")
        x, nodes = softplus.args[0], [softplus]
    elif is_op(softplus, aten.where):  # decomposed: where(x > 20, x, log1p(exp(x)))
        cond, x, small = softplus.args
        if not (is_op(cond, aten.gt) and cond.args[0] is x and is_op(small, aten.log1p)
                and is_op(small.args[0], aten.exp) and small.args[0].args[0] is x):
            raise NoMatch("sqrt of a where() that is not softplus's where(x > 20, x, log1p(exp(x)))")
        if scalar(cond.args[1]) != SOFTPLUS_THRESHOLD:
            raise NoMatch(f"softplus thresholded at {cond.args[1]}, not at torch's 20")
        nodes = [softplus, cond, small, small.args[0]]
        _computed_in_fp32([softplus, small, small.args[0]], "a softplus written out")
    else:
        raise NoMatch("sqrt of something that is not softplus: not a supported scoring function")
    return _Scoring("sqrtsoftplus", x, [sqrt, *inner[:-1], *nodes], softplus_dtype=_rounding(inner, "softplus values"))


def _softmax(div: fx.Node) -> _Scoring | None:
    """exp(x - max(x)) / sum(exp(x - max(x))) over the last dim (decomposed, online, or written out)."""
    num, den = div.args
    if not is_op(num, aten.exp) or not isinstance(den, fx.Node):
        return None
    sub = num.args[0]
    if not is_op(sub, aten.sub):
        if per_row(den, num, ("sum",)) is not None:
            raise NoMatch("a softmax without subtracting the row max (exp(x) / sum exp(x)): not torch's softmax")
        return None
    x, row_max = sub.args
    max_nodes = per_row(row_max, x, ("amax", "max", "online max"))
    sum_nodes = per_row(den, num, ("sum",)) or per_row(den, x, ("online sum",))
    if max_nodes is None or sum_nodes is None:
        reductions = [r for r in map(reduction, (walk(row_max)[-1], walk(den)[-1])) if r is not None]
        if any(len(dims) != 1 or not is_last_dim(dims[0], x) for _, _, dims in reductions):
            raise NoMatch("softmax over a dimension other than the experts")
        return None
    _computed_in_fp32([div, num, sub, den], "a softmax written out")
    return _Scoring("softmax", x, [div, num, sub, *max_nodes, *sum_nodes])


def _match_scoring(core: fx.Node) -> _Scoring:
    """The scoring op whose output (rounded, viewed) the top-k ranks."""
    if is_op(core, aten.sigmoid):
        return _Scoring("sigmoid", core.args[0], [core])
    if is_op(core, aten.sqrt):
        return _sqrt_softplus(core)
    if is_op(core, aten._softmax):
        if not is_last_dim(core.args[1], core):
            raise NoMatch("softmax over a dimension other than the experts")
        return _Scoring("softmax", core.args[0], [core])
    scoring = _spelled_sigmoid(core) or (_softmax(core) if is_op(core, aten.div) else None)
    if scoring is None:
        raise NoMatch(f"the top-k input is not a gate score (no sigmoid, sqrt-softplus or softmax over a GEMM; "
                      f"found {getattr(core.target, '__name__', core.target)})")
    return scoring


def _gemm_operands(top: fx.Node) -> tuple[fx.Node, fx.Node, bool, list[fx.Node]]:
    """(tokens operand, weight operand, whether that operand is W^T, the nodes from `top` down to
    the GEMM) of logits = u @ W^T. Inductor's shape padding (pad_mm, on GPUs) zero-pads a GEMM's
    operands to aligned sizes and slices its output back: zero rows and columns add nothing to
    the products, so the unpadded operands give the same logits."""
    gemm, slices = under_slices(top)
    if is_op(gemm, aten.addmm, aten.baddbmm) or is_op(gemm, aten.add) and any(
            is_op(under_slices(a)[0], aten.mm, aten.bmm) for a in gemm.args[:2]):  # unfused addmm (GPUs)
        raise NoMatch("the gate GEMM has a bias term (addmm): not a supported variant")
    if is_op(gemm, aten.bmm):  # einsum's form: [1, N, D] @ [1, D, E]
        if dims(gemm)[0] != 1:
            raise NoMatch("a batched GEMM over several weights: not one gate")
        linear = gemm.args[0], gemm.args[1], True
    else:
        linear = linear_operands(gemm, "gate GEMM")
    if linear is None:
        raise NoMatch("the scores do not come from a GEMM", candidate=False)
    tokens, weight, is_transposed = unpadded(linear[0]), unpadded(linear[1]), linear[2]
    experts = dims(weight)[-1] if is_transposed else dims(weight)[0]
    if dims(top) != dims(tokens)[:-1] + [experts]:
        raise NoMatch("the GEMM's output is cut to other sizes than its unpadded operands'")
    return tokens, weight, is_transposed, [*slices, gemm]


def _weight_input(operand: fx.Node, is_transposed: bool) -> _Input:
    """W [E, D] behind the GEMM's weight operand (W^T for mm / bmm, W for MKL's linear)."""
    path = walk(operand)
    source = path[-1]
    labels = source_dims(path)
    if rank(source) != 2 or labels is None or len(labels) != 2:
        raise NoMatch("the GEMM's second operand is not a view of an [experts, hidden] weight")
    experts_dim = labels[-1] if is_transposed else labels[0]
    arranged = {i: source_dims(path[i:]) if rank(n) == 2 else None for i, n in enumerate(path)}
    as_w = [path[i] for i, order in arranged.items() if order == [experts_dim, 1 - experts_dim]]
    as_w_t = [path[i] for i, order in arranged.items() if order == [1 - experts_dim, experts_dim]]
    picked = _pick_input(path, as_w, "the gate weight's values")
    if picked is None:  # stored [D, E]: the kernel reads it transposed
        picked = _pick_input(path, as_w_t, "the gate weight's values")
        if picked is None:
            raise NoMatch("the gate weight is rounded twice on the way to the GEMM: not one rounding")
        picked.transpose = True
    return picked


def _gather_of(ids: fx.Node, n_experts: int):
    """(weights, the tensor they are read from) where the chosen ids index a tensor over its last
    dim: gather (also take_along_dim's expand + remainder form) or scores[arange[:, None], ids];
    plus the nodes between. None if nothing reads ids that way."""
    frontier = [(ids, [])]
    while frontier:
        node, via = frontier.pop()
        for user in node.users:
            if is_op(user, aten.gather) and user.args[2] is node and is_last_dim(user.args[1], user.args[0]):
                return user, user.args[0], via
            if is_op(user, aten.index) and rank(user) == 2 and list(user.args[1])[1:] == [node]:
                if _is_row_numbers(user.args[1][0], dims(user)[0]):
                    return user, user.args[0], via
            if (is_op(user, aten.expand) and dims(user) == dims(node)) or (
                    is_op(user, aten.remainder) and scalar(user.args[1]) == n_experts):  # ids are already in [0, E)
                frontier.append((user, via + [user]))
    return None


def _is_row_numbers(node, n_rows) -> bool:
    """arange(n_rows)[:, None]: prims.iota(n_rows, start=0, step=1) made a column."""
    if not (is_op(node, aten.unsqueeze, aten.view, aten.reshape) and dims(node) == [n_rows, 1]):
        return False
    iota = node.args[0]
    return (is_op(iota, prims.iota) and iota.kwargs.get("start") == 0 and iota.kwargs.get("step") == 1
            and dims(iota) == [n_rows])


def _reads(node: fx.Node, target: fx.Node, depth: int = 4) -> bool:
    """`node` is computed from `target` within `depth` ops."""
    return node is target or depth > 0 and any(
        _reads(a, target, depth - 1) for a in node.all_input_nodes)


def _renormalisation(weights: fx.Node) -> tuple[fx.Node, float, list[fx.Node]] | None:
    """(w / (sum(w) [+ eps]), eps, its nodes) for the weights' renormalisation over the experts
    (the sum kept as [..., 1] by keepdim or an unsqueeze, before or after the eps); None where
    nothing divides them by something computed from them."""
    def unsqueezed(path):
        while is_op(path[-1], aten.unsqueeze, aten.view, aten.reshape):
            path.append(path[-1].args[0])
        return path

    for div in weights.users:
        if not (is_op(div, aten.div) and div.args[0] is weights and isinstance(div.args[1], fx.Node)):
            continue
        den = div.args[1]
        path, eps = unsqueezed([den]), 0.0
        if is_op(path[-1], aten.add) and scalar(path[-1].args[1]) is not None:
            eps = scalar(path[-1].args[1])
            path = unsqueezed(path + [path[-1].args[0]])
        found = reduction(path[-1])
        is_sum = found is not None and found[0] == "sum" and found[1] is weights
        if is_sum and len(found[2]) == 1 and is_last_dim(found[2][0], weights) and \
                dims(den) == dims(weights)[:-1] + [1]:
            return div, eps, [div, *path]
        if is_sum:
            raise NoMatch(f"the weights are divided by their sum over dims {found[2]}, not over the chosen experts")
        if _reads(den, weights):
            raise NoMatch(f"the weights are divided by {den.name}, computed from them but not their sum "
                          f"(+ eps) over the experts: not a renormalisation the kernel does")
    return None


def _forward_converts(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """Up through dtype converts that are a node's only user: (last node, converts)."""
    converts = []
    while len(node.users) == 1 and is_convert(next(iter(node.users))):
        node = next(iter(node.users))
        converts.append(node)
    return node, converts


def _per_expert(offset: fx.Node, of: fx.Node) -> bool:
    """`offset` adds one value per expert to `of` ([E], or [1, ..., E])."""
    sizes = dims(offset)
    return 1 <= len(sizes) <= rank(of) and sizes[-1] == dims(of)[-1] and all(s == 1 for s in sizes[:-1])


@register
class MegaGatePass(FusionPass):
    name = "mega_gate"
    description = "MoE gate: GEMM + scoring + bias + top-k + gather + renormalise + scale in one kernel"
    op = "megafuse::mega_gate"
    default_options = {"precision": "tf32x3"}
    option_choices = {"precision": gate_kernels.PRECISIONS}
    run_order = 20

    def anchors(self, graph: fx.Graph):
        return [n for n in graph.nodes if is_op(n, aten.topk)]

    def match(self, topk: fx.Node) -> Candidate:
        choice, k = topk.args[0], topk.args[1]
        dim, largest = arg(topk, 2, "dim", -1), arg(topk, 3, "largest", True)

        # 1. The choice: scores, or scores + one offset per expert (the bias), views and converts around.
        choice_path = walk(choice)
        bias_top, score_top = None, choice
        add = choice_path[-1]
        if is_op(add, aten.add) and all(isinstance(a, fx.Node) for a in add.args[:2]):
            if scalar(arg(add, 2, "alpha", 1)) != 1.0:
                raise NoMatch("scores + alpha * bias with alpha != 1")
            a, b = add.args[:2]
            if _per_expert(b, add) and dims(a) == dims(add):
                score_top, bias_top = a, b
            elif _per_expert(a, add) and dims(b) == dims(add):
                score_top, bias_top = b, a
            else:
                raise NoMatch("the selection offset is not one value per expert")

        # 2. The scoring, and the GEMM under it.
        score_path = walk(score_top)
        scoring = _match_scoring(score_path[-1])
        logits_path = walk(scoring.logits)
        tokens, weight_operand, is_transposed, gemm = _gemm_operands(logits_path[-1])
        logits_path += gemm[1:]
        weight = _weight_input(weight_operand, is_transposed)
        n_experts, hidden = weight.fake().shape
        for what, path in (("logits", logits_path), ("scores", score_path), ("choice", choice_path)):
            if not in_order(path):
                raise NoMatch(f"the {what} are permuted on the way to the top-k")
            if dims(path[0])[-1] != n_experts:
                raise NoMatch(f"the {what} have {dims(path[0])[-1]} values a row, not the {n_experts} experts")

        # 3. A top-k of the largest over the experts.
        if not is_last_dim(dim, choice):
            raise NoMatch(f"top-k runs over dim {dim}, not the expert dimension")
        if not largest:
            raise NoMatch("top-k of the smallest scores (largest=False)")
        if rank(choice) < 2:
            raise NoMatch("router scores of rank 1; the kernel takes [tokens, experts]")

        # 4. The weights: the unbiased scores at the chosen ids, read from a node of the score path.
        getitems = {u.args[1]: u for u in topk.users if u.target is operator.getitem}
        ids, values = getitems.get(1), getitems.get(0)
        if ids is None:
            raise NoMatch("the top-k indices are not used")
        chain = [topk, *getitems.values(), *choice_path, *score_path, *scoring.nodes, *logits_path]
        gathered = _gather_of(ids, n_experts)
        if gathered is not None:
            weights, source, via = gathered
            source_path = walk(source)
            if bias_top is not None and add in source_path:
                raise NoMatch("the selection bias also enters the weights (gather reads scores + bias)")
            on_scores = [i for i, n in enumerate(source_path) if n in score_path]
            if not on_scores or dims(source) != dims(choice):
                raise NoMatch("the gathered weights are not the scores at the chosen experts")
            scores = source_path[on_scores[0]]
            below = score_path[score_path.index(scores):]
            if _rounding(source_path[:on_scores[0]] + below, "the weights") != _rounding(below, "the scores"):
                raise NoMatch("the weights are the scores rounded again after the selection read them")
            chain += [weights, *via, *source_path[:on_scores[0]]]
        elif values is not None and bias_top is None:
            weights, scores = values, choice
        elif values is not None:
            raise NoMatch("the selection bias also enters the weights (they are the top-k values of scores + bias)")
        else:
            raise NoMatch("no gate weights: neither a gather of the scores nor the top-k values")

        # 5. Where the chain rounds: scores at the node the weights read, the choice above it.
        score_dtype = _rounding(score_path[score_path.index(scores):], "the scores")
        if scoring.softplus_dtype not in (None, score_dtype):
            raise NoMatch(f"sqrt(softplus) rounds softplus to {_dtype_name(scoring.softplus_dtype)} and the sqrt to "
                          f"{_dtype_name(score_dtype)}; the kernel rounds both to one dtype")
        if bias_top is not None:
            if _rounding(score_path, "the scores") != score_dtype:
                raise NoMatch("the selection adds the bias to the scores rounded again (the weights read them "
                              "unrounded): not reproducible")
            choice_dtype = _rounding(choice_path, "the biased choice")
        else:
            choice_dtype = _rounding(score_path, "the choice")

        # 6. Optional renormalisation w / (sum(w) [+ eps]), then an optional scale; converts between.
        final, eps, scale = weights, 0.0, 1.0
        end, converts = _forward_converts(final)
        renorm = _renormalisation(end)
        if renorm is not None:
            chain += converts + renorm[2]
            final, eps = renorm[0], renorm[1]
            end, converts = _forward_converts(final)
        mul = next((m for m in end.users if is_op(m, aten.mul) and scalar(m.args[1]) is not None), None)
        if mul is not None and len(end.users) == 1:
            chain += converts + [mul]
            final, scale = mul, scalar(mul.args[1])

        # 7. The inputs: u with the routing's leading dims, the bias as one value per expert.
        u_path = walk(tokens)
        if not in_order(u_path):
            raise NoMatch("the GEMM reads the tokens through a permutation")
        routing_dims = dims(ids)[:-1]
        u = _pick_input(u_path, [n for n in u_path if dims(n) == routing_dims + [hidden]], "the GEMM input")
        if u is None and all(isinstance(d, int) for d in routing_dims):  # the rewrite reshapes the outputs
            u = _pick_input(u_path, [n for n in u_path if dims(n)[-1:] == [hidden]], "the GEMM input")
        if u is None:
            raise NoMatch(f"no view of the tokens the GEMM reads has the routing's shape {routing_dims}")
        bias_path = walk(bias_top) if bias_top is not None else []
        bias = _pick_input(bias_path, bias_path, "the bias") if bias_path else None

        # 8. Everything but the two outputs must be private to the chain.
        inside = set(chain)
        nodes = [n for n in topk.graph.nodes if n in inside]  # graph order: the first leak is the one reported
        for node in nodes:
            if node not in (final, ids) and not all(user in inside for user in node.users):
                raise NoMatch(f"intermediate {node.name} is also used outside the gate chain")

        logits_dtype = _rounding(logits_path, "the logits")
        spec = ops.gate_spec(u.fake(), weight.fake(), bias.fake() if bias else None, scoring.func, int(k),
                             renorm is not None, eps, scale, self.options["precision"],
                             *map(_dtype_name, (logits_dtype, score_dtype, choice_dtype)))
        return Candidate(topk, nodes, spec,
                         inputs={"u": u, "weight": weight, "bias": bias}, outputs={"weights": final, "ids": ids})

    def check(self, candidate: Candidate) -> str | None:
        """The generator's support and the launcher's own input checks, on the match's fake tensors."""
        inputs = candidate.inputs
        bias = inputs["bias"].fake() if inputs["bias"] else None
        scalars = ops.gate_scalars(candidate.spec)
        return ops.gate_unsupported(inputs["u"].fake(), inputs["weight"].fake(), bias, *scalars)

    def rewrite(self, graph: fx.Graph, candidate: Candidate) -> fx.Node:
        spec, inputs, outputs = candidate.spec, candidate.inputs, candidate.outputs
        weights_val = val(outputs["weights"])
        with graph.inserting_before(candidate.anchor):
            u, weight = inputs["u"].materialise(graph), inputs["weight"].materialise(graph, spec.n_experts)
            bias = inputs["bias"].materialise(graph) if inputs["bias"] else None
            op = torch.ops.megafuse.mega_gate.default
            args = (u, weight, bias, *ops.gate_scalars(spec))
            fused = call(graph, op, args, ops.gate_fake(*(val(a) for a in args)))
            weights = call(graph, operator.getitem, (fused, 0), fused.meta["val"][0])
            ids = call(graph, operator.getitem, (fused, 1), fused.meta["val"][1])
            created = [fused, weights, ids]
            ids_val = val(outputs["ids"])
            if val(ids).shape != ids_val.shape:  # u's leading dims were folded away: [N, k] -> the routing's
                weights = call(graph, aten.reshape.default, (weights, list(ids_val.shape)),
                                weights_val.to(torch.float32))
                ids = call(graph, aten.reshape.default, (ids, list(ids_val.shape)), ids_val)
                created += [weights, ids]
            if weights_val.dtype != torch.float32:  # the chain ran in a lower precision
                weights = call(graph, prims.convert_element_type.default, (weights, weights_val.dtype), weights_val)
                created.append(weights)
        for node in created:
            node.meta["stack_trace"] = candidate.anchor.meta.get("stack_trace")
        outputs["weights"].replace_all_uses_with(weights)
        outputs["ids"].replace_all_uses_with(ids)
        return fused
