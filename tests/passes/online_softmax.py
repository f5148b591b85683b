"""The softmax form Inductor emits on CUDA, reproduced on CPU for the pass tests.

Where Triton generates the kernels, Inductor's post-grad pass rewrites a decomposed softmax
(amax, sub, exp, sum, div) into `prims.prepare_softmax_online(x, dim) -> (max, sum)` followed by
sub, exp, div (torch/_inductor/fx_passes/post_grad.py, `prepare_softmax_*`). Its extra check only
lets it fire on CUDA / XPU, so a CPU compile never shows the matchers that graph. This rewrite does
the same thing to a CPU graph; install it as Inductor's `post_grad_custom_pre_pass` (it runs
before megafuse's passes, which are the post pass) with `options=ONLINE_SOFTMAX`.
"""

import operator

import torch.fx as fx
from torch._inductor import inductor_prims  # noqa: F401  (registers prims.prepare_softmax_online)

from megafuse.passes.graph import aten, is_last_dim, is_op, prims


def online_softmax(graph: fx.Graph) -> None:
    for amax in [n for n in graph.nodes if is_op(n, aten.amax)]:
        x, dims = amax.args[0], amax.args[1]
        subs = [u for u in amax.users if is_op(u, aten.sub) and u.args == (x, amax)]
        if len(dims) != 1 or not is_last_dim(dims[0], x) or len(subs) != 1:
            continue
        exps = [u for u in subs[0].users if is_op(u, aten.exp)]
        sums = [u for u in exps[0].users if is_op(u, aten.sum)] if len(exps) == 1 else []
        if len(sums) != 1:
            continue
        with graph.inserting_before(amax):
            prepare = graph.call_function(prims.prepare_softmax_online.default, (x, -1))
            prepare.meta["val"] = (amax.meta["val"], sums[0].meta["val"])
            items = []
            for index, old in enumerate((amax, sums[0])):
                item = graph.call_function(operator.getitem, (prepare, index))
                item.meta["val"] = old.meta["val"]
                items.append(item)
        sums[0].replace_all_uses_with(items[1])
        amax.replace_all_uses_with(items[0])
        graph.erase_node(sums[0])
        graph.erase_node(amax)
    graph.lint()


ONLINE_SOFTMAX = {"post_grad_custom_pre_pass": online_softmax}


def count_online_softmax(graph: fx.Graph) -> int:
    return sum(is_op(n, prims.prepare_softmax_online) for n in graph.nodes)
