"""Mega-Gate: the MoE router chain -> one generated Triton kernel.

Pattern (post-grad ATen graph, anchored at `aten.topk`), as a family:

    logits  = mm(u, W^T)                      u, W in fp32 or bf16 (converts and views around are fine)
    scores  = score(logits)                   sigmoid | sqrt(softplus) | softmax over the experts
    choice  = scores [+ bias]                 bias: one value per expert, selection only
    ids     = topk(choice, k, dim=-1)[1]
    w       = gather(scores, -1, ids)         or topk(...)[0] when there is no bias (choice == scores)
    w       = w / (sum(w) [+ eps])            optional renormalisation
    w       = w * scale                       optional scale

Replacement: `(w, ids) = megafuse::mega_gate(u, W, bias, score_func, k, renorm, eps, scale, precision)`,
whose reference is `model.moe.route`; Inductor lowers it to the kernel `lowering.mega_gate` generates.

Why they are equal: the kernel computes the same fp32 logits, scores and biased choice, picks the
k largest by iterated arg-max (ties to the lowest index; `torch.topk` leaves tie order open) and
gathers the unbiased scores at the chosen ids, then renormalises and scales exactly as the chain.

Not this pattern (near misses, rejected with the reason): the bias also entering the weights
(gather from scores + bias), top-k over another dimension, top-k over raw logits (e.g. a softmax
applied after the top-k), a GEMM with a bias term, intermediates used outside the chain, and
selections that are not a top-k at all (hash routing's table lookup has no top-k to anchor on).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from lowering import mega_gate as gate_kernels

from .base import Candidate, FusionPass, NoMatch
from .graph import (MKL_LINEAR, aten, arg, dtype, is_last_dim, is_op, linear_operands, linear_weight, only_users_in,
                    rank, scalar, strip, val)
from .registry import register

SOFTPLUS_THRESHOLD = 20.0  # torch's softplus default: x for x > 20


def _match_scoring(scores: fx.Node) -> tuple[fx.Node, str, list[fx.Node]]:
    """(logits, score_func, nodes of the scoring) or NoMatch."""
    if is_op(scores, aten.sigmoid):
        return scores.args[0], "sigmoid", [scores]
    if is_op(scores, aten.sqrt):
        inner = scores.args[0]
        if is_op(inner, aten.softplus):
            if scalar(arg(inner, 1, "beta", 1)) != 1.0 or scalar(arg(inner, 2, "threshold", 20)) != SOFTPLUS_THRESHOLD:
                raise NoMatch("softplus with beta != 1 or threshold != 20 is not a supported scoring variant")
            return inner.args[0], "sqrtsoftplus", [scores, inner]
        if is_op(inner, aten.where):  # decomposed softplus: where(x > 20, x, log1p(exp(x)))
            cond, big, small = inner.args
            if (is_op(cond, aten.gt) and scalar(cond.args[1]) == SOFTPLUS_THRESHOLD and cond.args[0] is big
                    and is_op(small, aten.log1p) and is_op(small.args[0], aten.exp) and small.args[0].args[0] is big):
                return big, "sqrtsoftplus", [scores, inner, cond, small, small.args[0]]
        raise NoMatch("sqrt of something that is not softplus: not a supported scoring function")
    if is_op(scores, aten._softmax):
        if not is_last_dim(scores.args[1], scores):
            raise NoMatch("softmax over a dimension other than the experts")
        return scores.args[0], "softmax", [scores]
    if is_op(scores, aten.div):  # decomposed softmax: exp(x - amax(x)) / sum(exp(x - amax(x)))
        num, den = scores.args
        if (is_op(num, aten.exp) and is_op(num.args[0], aten.sub) and is_op(den, aten.sum) and den.args[0] is num
                and is_op(num.args[0].args[1], aten.amax)):
            sub, amax = num.args[0], num.args[0].args[1]
            x = sub.args[0]
            if amax.args[0] is x and all(is_last_dim(d, x) for d in (*amax.args[1], *den.args[1])):
                return x, "softmax", [scores, num, sub, amax, den]
    raise NoMatch(f"the top-k input is not a gate score (no sigmoid, sqrt-softplus or softmax over a GEMM; "
                  f"found {getattr(scores.target, '__name__', scores.target)})")


def _match_gemm(logits: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]]:
    """(u [N, D], W [E, D], nodes) for logits = mm(u, W^T), or NoMatch(candidate=False)."""
    mm, skipped = strip(logits)
    if is_op(mm, aten.addmm):
        raise NoMatch("the gate GEMM has a bias term (addmm): not a supported variant")
    linear = linear_operands(mm, "gate GEMM")
    if linear is None:
        raise NoMatch("the scores do not come from a GEMM", candidate=False)
    u, w_t, transposed = linear
    found = linear_weight(w_t, val(mm).shape[-1], transposed, "gate weight")
    if found is None:
        raise NoMatch("the GEMM's second operand is not a transposed [experts, hidden] weight")
    weight, weight_converts = found
    u_source = u.args[0] if is_op(u, torch.ops.prims.convert_element_type) else u
    nodes = [*skipped, mm, w_t, *weight_converts] + ([u] if u_source is not u else [])
    return u_source, weight, nodes


@register
class MegaGatePass(FusionPass):
    name = "mega_gate"
    description = "MoE gate: GEMM + scoring + bias + top-k + gather + renormalise + scale in one kernel"
    op = "megafuse::mega_gate"
    default_options = {"precision": "tf32x3"}
    run_order = 20

    def anchors(self, graph: fx.Graph):
        return [n for n in graph.nodes if is_op(n, aten.topk)]

    def match(self, topk: fx.Node) -> Candidate:
        choice, k = topk.args[0], topk.args[1]
        dim, largest = arg(topk, 2, "dim", -1), arg(topk, 3, "largest", True)

        # 1. The choice: scores, or scores + a per-expert bias.
        bias, chain = None, [topk]
        scores = choice
        if is_op(choice, aten.add) and len(choice.args) == 2 and all(isinstance(a, fx.Node) for a in choice.args):
            a, b = choice.args
            if rank(b) == 1 and rank(a) == 2:
                scores, bias, chain = a, b, chain + [choice]
            elif rank(a) == 1 and rank(b) == 2:
                scores, bias, chain = b, a, chain + [choice]
        logits, score_func, scoring = _match_scoring(scores)
        u, weight, gemm = _match_gemm(logits)
        chain += scoring + gemm
        if dtype(scores) != torch.float32:
            raise NoMatch(f"the scores are computed in {dtype(scores)}; the kernel scores in fp32 "
                          f"(upcast the logits before scoring to fuse)")

        # 2. A top-k over the experts.
        if not is_last_dim(dim, choice):
            raise NoMatch(f"top-k runs over dim {dim}, not the expert dimension")
        if not largest:
            raise NoMatch("top-k of the smallest scores (largest=False)")
        if rank(choice) != 2:
            raise NoMatch(f"router scores of rank {rank(choice)}; the kernel takes [tokens, experts]")
        if bias is not None and val(bias).shape[0] != val(weight).shape[0]:
            raise NoMatch("the selection offset is not one value per expert")

        # 3. The weights: the unbiased scores at the chosen ids.
        getitems = {u_.args[1]: u_ for u_ in topk.users if u_.target is operator.getitem}
        ids, values = getitems.get(1), getitems.get(0)
        if ids is None:
            raise NoMatch("the top-k indices are not used")
        chain += list(getitems.values())
        gathers = [g for g in ids.users if is_op(g, aten.gather)]
        if gathers:
            weights = gathers[0]
            source = weights.args[0]
            if source is choice and bias is not None:
                raise NoMatch("the selection bias also enters the weights (gather reads scores + bias)")
            if source is not scores or not is_last_dim(weights.args[1], scores):
                raise NoMatch("the gathered weights are not the scores at the chosen experts")
        elif values is not None and bias is None:
            weights = values
        else:
            raise NoMatch("no gate weights: neither a gather of the scores nor the top-k values")
        chain.append(weights)

        # 4. Optional renormalisation w / (sum(w) [+ eps]), then an optional scale.
        final, renorm, eps, scale = weights, False, 0.0, 1.0
        div = next((d for d in final.users if is_op(d, aten.div) and d.args[0] is final), None)
        if div is not None:
            den = div.args[1]
            total = den
            if is_op(den, aten.add) and scalar(den.args[1]) is not None:
                total, eps = den.args[0], scalar(den.args[1])
            if is_op(total, aten.sum) and total.args[0] is final and all(is_last_dim(d, final) for d in total.args[1]):
                chain += [div, total] + ([den] if den is not total else [])
                final, renorm = div, True
        mul = next((m for m in final.users if is_op(m, aten.mul) and scalar(m.args[1]) is not None), None)
        if mul is not None and len(final.users) == 1:
            chain.append(mul)
            final, scale = mul, scalar(mul.args[1])

        # 5. Everything but the two outputs must be private to the chain.
        inside = set(chain)
        for node in chain:
            if node not in (final, ids) and not only_users_in(node, inside):
                raise NoMatch(f"intermediate {node.name} is also used outside the gate chain")

        spec = {
            "score_func": score_func, "k": int(k), "has_bias": bias is not None, "renorm": renorm,
            "renorm_eps": eps, "scale": scale, "n_experts": val(weight).shape[0], "hidden": val(weight).shape[1],
            "input_dtype": str(dtype(u)).removeprefix("torch."),
            "weight_dtype": str(dtype(weight)).removeprefix("torch."),
            "precision": self.options["precision"],
            "logits_dtype": str(dtype(next(n for n in gemm if is_op(n, aten.mm, *MKL_LINEAR)))).removeprefix("torch."),
        }
        return Candidate(topk, [n for n in topk.graph.nodes if n in inside], spec,
                         inputs={"u": u, "weight": weight, "bias": bias}, outputs={"weights": final, "ids": ids})

    def check(self, candidate: Candidate) -> str | None:
        spec = gate_kernels.GateSpec(**candidate.spec)
        return gate_kernels.unsupported_reason(spec)

    def rewrite(self, graph: fx.Graph, candidate: Candidate) -> fx.Node:
        s, inputs, outputs = candidate.spec, candidate.inputs, candidate.outputs
        args = (inputs["u"], inputs["weight"], inputs["bias"], s["score_func"], s["k"], s["renorm"],
                s["renorm_eps"], s["scale"], s["precision"], s["logits_dtype"])
        weights_val = val(outputs["weights"])
        with graph.inserting_before(candidate.anchor):
            fused = graph.call_function(torch.ops.megafuse.mega_gate.default, args)
            weights = graph.call_function(operator.getitem, (fused, 0))
            ids = graph.call_function(operator.getitem, (fused, 1))
            fused.meta["val"] = (weights_val.to(torch.float32), val(outputs["ids"]))
            weights.meta["val"], ids.meta["val"] = fused.meta["val"]
            result = weights
            if weights_val.dtype != torch.float32:  # the chain ran in a lower precision
                result = graph.call_function(torch.ops.prims.convert_element_type.default, (weights, weights_val.dtype))
                result.meta["val"] = weights_val
        for node in (fused, weights, ids, result):
            node.meta["stack_trace"] = candidate.anchor.meta.get("stack_trace")
        outputs["weights"].replace_all_uses_with(result)
        outputs["ids"].replace_all_uses_with(ids)
        return fused
