"""Small readers of the post-grad ATen graph shared by the passes."""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
prims = torch.ops.prims

# Ops that change a tensor's layout or name but not its numbers.
LAYOUT_OPS = (aten.view, aten._unsafe_view, aten.reshape, aten.clone, aten.alias)


def is_op(node, *packets) -> bool:
    """node is a call of one of the op packets (any overload): is_op(n, aten.mm, aten.addmm)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    target = getattr(node.target, "overloadpacket", node.target)
    return any(target is p for p in packets)


def is_convert(node) -> bool:
    return is_op(node, prims.convert_element_type) or (
        is_op(node, aten._to_copy) and set(node.kwargs) <= {"dtype"})


def strip(node, *, layout: bool = True, converts: bool = True) -> tuple[fx.Node, list[fx.Node]]:
    """Walk down through no-op layout ops and dtype converts; (underlying node, nodes skipped)."""
    skipped = []
    while True:
        if converts and is_convert(node) or layout and is_op(node, *LAYOUT_OPS):
            skipped.append(node)
            node = node.args[0]
        else:
            return node, skipped


def val(node):
    """The fake tensor (or value) Inductor keeps for a node."""
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def rank(node) -> int | None:
    v = val(node)
    return v.dim() if isinstance(v, torch.Tensor) else None


def dtype(node) -> torch.dtype | None:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def is_last_dim(dim, node) -> bool:
    r = rank(node)
    return dim == -1 or (r is not None and dim == r - 1)


def arg(node: fx.Node, index: int, name: str, default=None):
    """Positional-or-keyword argument of an ATen call."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def scalar(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def only_users_in(node: fx.Node, allowed: set) -> bool:
    return all(u in allowed for u in node.users)
