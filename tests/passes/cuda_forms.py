"""The GEMM forms Inductor emits on GPUs, reproduced on CPU for the pass tests (with the online
softmax of online_softmax.py), so the CPU tests see the graphs a CUDA compile gives the passes.

Three rewrites of Inductor's only fire on CUDA / XPU (their checks ask for the device):
- bmm_to_mm (joint_graph.py): a bmm whose operands have batch size 1 (at T = 1) becomes
      mm(a.squeeze(0), b.squeeze(0)).unsqueeze(0)
  `batch_one_bmm_as_mm` does it to every such bmm.
- shape padding (torch/_inductor/fx_passes/pad_mm.py): an mm / bmm with a size that is not a
  multiple of 8 (16-bit) or 4 (fp32) elements is zero-padded up to aligned sizes, where its
  benchmark finds that faster, and the padding sliced off its output:
      mm(a, b) -> mm(constant_pad_nd(a, [0, pk, 0, pm]), constant_pad_nd(b, [0, pn, 0, pk]))[:-pm, :-pn]
  `shape_padding` pads every unaligned GEMM (a GPU pads some).
- unfuse_bias_add_to_pointwise (post_grad.py): addmm(bias, a, b) whose users are pointwise ->
  mm(a, b) + bias. `unfused_bias` does it to every addmm.

A third difference is the torch version's, not the device's: `lossy_round_trips` is torch 2.11's
joint-graph `pointless_convert` (pytorch/pytorch#180575 keeps the rounding from 2.12 on), which
rewrites convert(convert(x, bf16), fp32) as x: a value rounded to bf16 and widened again is read
unrounded. `TORCH_2_11_FORMS` adds it to `CUDA_FORMS`: the graphs the H200 (torch 2.11) gives.

Install `CUDA_FORMS` as Inductor's options (`inductor_config.patch(CUDA_FORMS)`): it runs as the
post-grad custom pre-pass, before megafuse's passes.
"""

import torch
import torch.fx as fx

from megafuse.passes.graph import aten, is_convert, is_op, prims
from tests.passes.online_softmax import online_softmax


def _call(graph: fx.Graph, target, args, fake) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = fake
    return node


def batch_one_bmm_as_mm(graph: fx.Graph) -> None:
    for bmm in [n for n in graph.nodes if is_op(n, aten.bmm)]:
        a, b = bmm.args
        if a.meta["val"].shape[0] != 1 or b.meta["val"].shape[0] != 1:
            continue
        with graph.inserting_before(bmm):
            a, b = (_call(graph, aten.squeeze.dim, (x, 0), x.meta["val"].squeeze(0)) for x in (a, b))
            mm = _call(graph, aten.mm.default, (a, b), aten.mm(a.meta["val"], b.meta["val"]))
            out = _call(graph, aten.unsqueeze.default, (mm, 0), bmm.meta["val"])
        bmm.replace_all_uses_with(out)
        graph.erase_node(bmm)
    graph.lint()


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


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def lossy_round_trips(graph: fx.Graph) -> None:
    for node in list(graph.nodes):
        inner = node.args[0] if is_convert(node) else None
        if not is_convert(inner) or inner.args[1] not in _FLOATS or node.args[1] not in _FLOATS:
            continue
        source = inner.args[0]
        if getattr(source.meta.get("val"), "dtype", None) not in _FLOATS:
            continue
        if source.meta["val"].dtype == node.args[1]:
            node.replace_all_uses_with(source)  # (Inductor then drops the no-op convert)
        else:
            with graph.inserting_before(node):
                node.replace_all_uses_with(_call(graph, prims.convert_element_type.default, (source, node.args[1]),
                                                 node.meta["val"]))
        graph.erase_node(node)
        if not inner.users:
            graph.erase_node(inner)
    graph.lint()


def cuda_forms(graph: fx.Graph) -> None:
    batch_one_bmm_as_mm(graph)
    online_softmax(graph)
    unfused_bias(graph)
    shape_padding(graph)


CUDA_FORMS = {"post_grad_custom_pre_pass": cuda_forms}


def torch_2_11_forms(graph: fx.Graph) -> None:
    lossy_round_trips(graph)
    cuda_forms(graph)


TORCH_2_11_FORMS = {"post_grad_custom_pre_pass": torch_2_11_forms}
