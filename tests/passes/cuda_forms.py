"""The GEMM forms Inductor emits on GPUs, reproduced on CPU for the pass tests (with the online
softmax of online_softmax.py), so the CPU tests see the graphs a CUDA compile gives the passes.

Two post-grad rewrites of Inductor's only fire on CUDA / XPU (their checks ask for the device):
- shape padding (torch/_inductor/fx_passes/pad_mm.py): an mm / bmm with a size that is not a
  multiple of 8 (16-bit) or 4 (fp32) elements is zero-padded up to aligned sizes, where its
  benchmark finds that faster, and the padding sliced off its output:
      mm(a, b) -> mm(constant_pad_nd(a, [0, pk, 0, pm]), constant_pad_nd(b, [0, pn, 0, pk]))[:-pm, :-pn]
  `shape_padding` pads every unaligned GEMM (a GPU pads some).
- unfuse_bias_add_to_pointwise (post_grad.py): addmm(bias, a, b) whose users are pointwise ->
  mm(a, b) + bias. `unfused_bias` does it to every addmm.

Install `CUDA_FORMS` as Inductor's options (`inductor_config.patch(CUDA_FORMS)`): it runs as the
post-grad custom pre-pass, before megafuse's passes.
"""

import torch
import torch.fx as fx

from passes.graph import aten, is_op
from tests.passes.online_softmax import online_softmax


def _call(graph: fx.Graph, target, args, fake) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = fake
    return node


def shape_padding(graph: fx.Graph) -> None:
    for gemm in [n for n in graph.nodes if is_op(n, aten.mm, aten.bmm)]:
        a, b = gemm.args
        va, vb = a.meta["val"], b.meta["val"]
        align = 8 if va.dtype in (torch.bfloat16, torch.float16) else 4
        m, k, n = va.shape[-2], va.shape[-1], vb.shape[-1]
        pm, pk, pn = (-size % align if isinstance(size, int) else 0 for size in (m, k, n))
        if not (pm or pk or pn):
            continue
        batch = [0, 0] if is_op(gemm, aten.bmm) else []
        with graph.inserting_before(gemm):
            pad_a, pad_b = [0, pk, 0, pm, *batch], [0, pn, 0, pk, *batch]
            a = _call(graph, aten.constant_pad_nd.default, (a, pad_a), aten.constant_pad_nd(va, pad_a))
            b = _call(graph, aten.constant_pad_nd.default, (b, pad_b), aten.constant_pad_nd(vb, pad_b))
            out = _call(graph, gemm.target, (a, b), gemm.target(a.meta["val"], b.meta["val"]))
            for dim, cut in ((-2, pm), (-1, pn)):
                if cut:
                    out = _call(graph, aten.slice.Tensor, (out, out.meta["val"].dim() + dim, 0, -cut),
                                aten.slice.Tensor(out.meta["val"], dim, 0, -cut))
        gemm.replace_all_uses_with(out)
        graph.erase_node(gemm)
    graph.lint()


def unfused_bias(graph: fx.Graph) -> None:
    for addmm in [n for n in graph.nodes if is_op(n, aten.addmm) and not n.kwargs]:
        bias, a, b = addmm.args
        with graph.inserting_before(addmm):
            mm = _call(graph, aten.mm.default, (a, b), aten.mm(a.meta["val"], b.meta["val"]))
            out = _call(graph, aten.add.Tensor, (mm, bias), addmm.meta["val"])
        addmm.replace_all_uses_with(out)
        graph.erase_node(addmm)
    graph.lint()


def cuda_forms(graph: fx.Graph) -> None:
    online_softmax(graph)
    unfused_bias(graph)
    shape_padding(graph)


CUDA_FORMS = {"post_grad_custom_pre_pass": cuda_forms}
