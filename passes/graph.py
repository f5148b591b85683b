"""Small readers of the post-grad ATen graph shared by the passes."""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from .base import NoMatch

aten = torch.ops.aten
prims = torch.ops.prims

# Inductor's freezing on CPU (with weight prepacking) turns x @ W^T with a frozen W into MKL's
# linear: (x, packed W, W, bias, batch). Not every build has it.
try:
    MKL_LINEAR = (torch.ops.mkl._mkl_linear,)
except (AttributeError, RuntimeError):
    MKL_LINEAR = ()

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


def size_of(size):
    """A size as the matchers compare and hash it: an int, or a symbolic size's sympy expression
    (a dynamic row count: SymInts do not hash, their expressions compare structurally)."""
    return size.node.expr if isinstance(size, torch.SymInt) else int(size)


def known_less(a, b) -> bool:
    """a < b for sizes from size_of: exact for ints; for symbolic sizes, true only where the
    compile's value ranges prove it, so a match never adds a guard."""
    if isinstance(a, int) and isinstance(b, int):
        return a < b
    fake_mode = torch._guards.detect_fake_mode()  # the compile's, whose ShapeEnv holds the ranges
    shape_env = fake_mode.shape_env if fake_mode is not None else None
    return shape_env is not None and shape_env.bound_sympy(sympy.sympify(b) - a).lower > 0


def shape(node) -> tuple:
    """The node's shape, each size through size_of."""
    return tuple(size_of(d) for d in val(node).shape)


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


def zero_or_below(node, floor: float) -> bool:
    """Every element of `node` is provably 0 or <= `floor` (an additive mask that keeps or removes),
    read from how the graph builds it: fills, where, scatter, cat, add, slices, views and float
    converts of such values (a mask built elsewhere, a graph input, proves nothing)."""
    if not isinstance(node, fx.Node):
        return scalar(node) is not None and (scalar(node) == 0 or scalar(node) <= floor)
    if is_op(node, aten.full):  # full(size, value)
        return zero_or_below(node.args[1], floor)
    if is_op(node, aten.scalar_tensor):
        return zero_or_below(node.args[0], floor)
    if is_op(node, aten.zeros):
        return True
    if is_op(node, aten.where):
        return all(zero_or_below(x, floor) for x in node.args[1:3])
    if is_op(node, aten.scatter) and len(node.args) == 4 and not node.kwargs:  # (x, dim, index, value or src)
        return all(zero_or_below(x, floor) for x in (node.args[0], node.args[3]))
    if is_op(node, aten.cat):
        return all(zero_or_below(x, floor) for x in node.args[0])
    if is_op(node, aten.add, aten.minimum):  # 0 + 0 = 0; anything <= floor plus <= 0 stays <= floor
        return all(zero_or_below(x, floor) for x in node.args[:2])
    if is_convert(node):  # a float cast keeps 0 and sends a value <= floor to <= floor or -inf
        return (dtype(node) or torch.int32).is_floating_point and zero_or_below(node.args[0], floor)
    if moves(node) or is_op(node, aten.slice, aten.select, aten.expand, *LAYOUT_OPS):
        return zero_or_below(node.args[0], floor)
    return False


def sole_user(node: fx.Node) -> fx.Node | None:
    """The one node that reads `node`, or None where it has none or several."""
    return next(iter(node.users)) if len(node.users) == 1 else None


def only_users_in(node: fx.Node, allowed: set) -> bool:
    return all(u in allowed for u in node.users)


def linear_operands(node: fx.Node, what: str) -> tuple[fx.Node, fx.Node, bool] | None:
    """(x, weight operand, transposed) of x @ W^T: an mm (its operand W^T, transposed) or, under
    Inductor's freezing on CPU with weight prepacking, MKL's linear (its operand W itself); None for
    anything else. A linear with a bias term is NoMatch (`what` names it)."""
    if is_op(node, aten.mm):
        return node.args[0], node.args[1], True
    if is_op(node, *MKL_LINEAR):
        if node.args[3] is not None:
            raise NoMatch(f"the {what} has a bias term (MKL linear): not a supported variant")
        return node.args[0], node.args[2], False
    return None


def frozen_value(node: fx.Node) -> torch.Tensor | None:
    """The tensor behind a get_attr node (a weight Inductor's freezing made a constant), else None."""
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value = node.graph.owning_module
    for part in node.target.split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) else None


def new_constant(graph: fx.Graph, after: fx.Node, name: str, value: torch.Tensor) -> fx.Node:
    """A new constant of the GraphModule, read by a get_attr node placed after `after` and carrying
    the fake value the passes read. Made once at compile time: frozen weights do not change."""
    gm = graph.owning_module
    name = next(f"_megafuse_{name}{k}" for k in range(1 << 20) if not hasattr(gm, f"_megafuse_{name}{k}"))
    gm.register_buffer(name, value)
    with graph.inserting_after(after):
        node = graph.get_attr(name)
    with val(after).fake_mode:
        node.meta["val"] = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    return node


def frozen_weight(node: fx.Node, rows: int, transposed: bool, what: str) -> fx.Node | None:
    """A weight [rows, cols] as a contiguous constant, from the get_attr Inductor's freezing made of
    it: `transposed` where the folded constant is W^T (an mm's operand), else W itself (MKL's
    linear keeps it). None if `node` is not a frozen constant; NoMatch (from the caller's `what`)
    if its shape does not fit."""
    value = frozen_value(node)
    if value is None:
        return None
    weight = value.t() if transposed and value.dim() == 2 else value
    if weight.dim() != 2 or weight.shape[0] != rows:
        raise NoMatch(f"the frozen {what} {list(value.shape)} is not "
                      f"{'[cols, %d]' % rows if transposed else '[%d, cols]' % rows}")
    return new_constant(node.graph, node, what.replace(" ", "_"), weight.contiguous())


def linear_weight(w_t: fx.Node, rows: int, transposed: bool, what: str) -> tuple[fx.Node, list[fx.Node]] | None:
    """The weight W [rows, cols] of x @ W^T from the linear's weight operand (linear_operands), and
    the dtype converts between W and that operand: a frozen constant (frozen_weight), or W read
    through its transpose (t, or permute(1, 0)). None if the operand is neither."""
    weight = frozen_weight(w_t, rows, transposed=transposed, what=what)
    if weight is not None:
        return weight, []
    if not is_op(w_t, aten.permute, aten.t) or (is_op(w_t, aten.permute) and list(w_t.args[1]) != [1, 0]):
        return None
    return strip(w_t.args[0], layout=False)


def last_dim_parts(node: fx.Node, sizes: list[int]) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """The readers of `node`'s consecutive parts of `sizes` along its last dim, in order, and the
    split they hang off ([] for slices): `split` / `split_with_sizes` getitems, or last-dim slices
    (`t[..., a:b]`, `narrow`; torch 2.14 rewrites a split into slices anyway). None if some part
    has no reader."""
    size = val(node).shape[-1] if rank(node) else None
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    if size is None or bounds[-1] != size:
        return None
    for split in node.users:
        if not is_op(split, aten.split_with_sizes, aten.split) or split.args[0] is not node:
            continue
        chunk = split.args[1]
        split_sizes = (list(chunk) if isinstance(chunk, (list, tuple))
                       else [min(chunk, size - a) for a in range(0, size, chunk)])
        items = {u.args[1]: u for u in split.users if u.target is operator.getitem}
        if (is_last_dim(arg(split, 2, "dim", 0), node) and split_sizes == list(sizes)
                and set(items) == set(range(len(sizes)))):
            return [items[i] for i in range(len(sizes))], [split]
    slices = {}
    for user in node.users:
        if not is_op(user, aten.slice) or user.args[0] is not node or not is_last_dim(arg(user, 1, "dim", 0), node):
            continue
        start, end, step = arg(user, 2, "start"), arg(user, 3, "end"), arg(user, 4, "step", 1)
        start = 0 if start is None else start + size if start < 0 else start
        end = size if end is None else end + size if end < 0 else min(end, size)
        if step == 1:
            slices.setdefault((start, end), user)
    parts = [slices.get((bounds[i], bounds[i + 1])) for i in range(len(sizes))]
    return (parts, []) if all(p is not None for p in parts) else None


# Inductor's shape padding (torch/_inductor/fx_passes/pad_mm.py, on GPUs) zero-pads an unaligned
# GEMM's operands to aligned sizes and slices the padding off its output: zero rows and columns add
# nothing to the products, so the GEMM of the unpadded operands gives the same values.

def unpadded(operand: fx.Node) -> fx.Node:
    """x where `operand` is x zero-padded after the end of its dims (constant_pad_nd), else operand."""
    if is_op(operand, aten.constant_pad_nd) and scalar(arg(operand, 2, "value", 0)) == 0.0:
        pads = list(operand.args[1])
        if all(p == 0 for p in pads[::2]) and all(isinstance(p, int) and p >= 0 for p in pads[1::2]):
            return operand.args[0]
    return operand


def keeps_leading(node: fx.Node) -> bool:
    """node = x[.., :m, ..]: a slice that keeps the leading part of one dim."""
    return is_op(node, aten.slice) and arg(node, 4, "step", 1) == 1 and not arg(node, 2, "start", 0)


def under_slices(node):
    """(x, the slices) where `node` keeps leading parts of x's dims (x[:m, :n]), else (node, [])."""
    slices = []
    while keeps_leading(node):
        slices.append(node)
        node = node.args[0]
    return node, slices


# ---- views, reductions and new nodes (shared by the passes) ----------------------------------------

# Ops that move values without changing them (an expand only when it keeps the shape).
RESHAPES = (aten.view, aten._unsafe_view, aten.reshape, aten.unsqueeze, aten.squeeze, aten.clone, aten.alias,
            aten.expand)
TRANSPOSES = (aten.permute, aten.t, aten.transpose)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


# ---- views and converts --------------------------------------------------------------------------

def dims(node) -> list:
    """The shape, symbolic sizes as text (comparing them must not add guards to the graph)."""
    v = val(node)
    return [s if isinstance(s, int) else str(s) for s in v.shape] if isinstance(v, torch.Tensor) else []


def moves(node) -> bool:
    if is_op(node, aten.expand):
        return dims(node) == dims(node.args[0])
    if node.target is torch.ops.aten.view.dtype:  # reinterprets the bits: a new value, not a move
        return False
    return is_op(node, *RESHAPES, *TRANSPOSES)


def walk(node: fx.Node) -> list[fx.Node]:
    """[node, ..., source]: down through ops that move values and dtype converts, to the first node
    that is neither."""
    path = [node]
    while moves(path[-1]) or is_convert(path[-1]):
        path.append(path[-1].args[0])
    return path


def perm(node: fx.Node) -> list[int]:
    n = rank(node.args[0])
    if is_op(node, aten.permute):
        return [d % n for d in node.args[1]]
    if is_op(node, aten.t):
        return list(range(n))[::-1]
    order = list(range(n))
    a, b = node.args[1] % n, node.args[2] % n
    order[a], order[b] = order[b], order[a]
    return order


def in_order(path: list[fx.Node]) -> bool:
    """The top of `path` holds its source's values in the same row-major order: reshapes never
    reorder, and every transpose moves only size-1 dims."""
    for node in path[:-1]:
        if is_op(node, *TRANSPOSES):
            sizes = dims(node.args[0])
            kept = [d for d in perm(node) if sizes[d] != 1]
            if kept != sorted(kept):
                return False
    return True


def _regroup(labels: list[tuple], atoms: dict, sizes: list) -> list[tuple] | None:
    """The labels of a reshape to `sizes` of a tensor whose dims hold `labels` (row-major order)."""
    pending = [d for label in labels for d in label]
    regrouped = []
    for size in sizes:
        group, product = [], 1
        while size != 1 and product != size and pending:
            group.append(pending.pop(0))
            product = product * atoms[group[-1]]
        if product != size:
            return None
        regrouped.append(tuple(group))
    return None if pending else regrouped


def source_groups(path: list[fx.Node], *, inverse: bool = False) -> list[tuple[int, ...]] | None:
    """For each dim of the top of `path` ([top, ..., source], as `walk` returns it) larger than 1,
    in order, the source's dims (larger than 1) it holds in row-major order: (d,) for a dim that is
    source dim d, (a, b) where a reshape merged a and b. None where a reshape splits a source dim.
    `inverse`: the other way round, the source's dims in terms of the top's (the path undone)."""
    start = path[0] if inverse else path[-1]
    atoms = {d: size_of(s) for d, s in enumerate(val(start).shape) if size_of(s) != 1}
    labels = [(d,) if d in atoms else () for d in range(rank(start))]
    steps = [(node, path[i + 1]) for i, node in enumerate(path[:-1])]  # (node, its input)
    for node, below in (steps if inverse else steps[::-1]):
        if is_op(node, *TRANSPOSES):
            order = perm(node)
            if inverse:
                undone = [()] * len(order)
                for k, d in enumerate(order):
                    undone[d] = labels[k]
                labels = undone
            else:
                labels = [labels[d] for d in order]
        elif not is_convert(node):
            labels = _regroup(labels, atoms, [size_of(s) for s in val(below if inverse else node).shape])
            if labels is None:
                return None
    return [label for label in labels if label]


def source_dims(path: list[fx.Node]) -> list[int] | None:
    """For each dim of the top of `path` larger than 1, in order, the dim of the source it is;
    None where a reshape merges or splits dims (then the top is no transposition of the source)."""
    groups = source_groups(path)
    return None if groups is None or any(len(g) != 1 for g in groups) else [g[0] for g in groups]


def call(graph: fx.Graph, target, args, fake) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = fake
    return node


def reduction(node: fx.Node):
    """(kind, input, dims) of a reduction: sum, amax, max.dim's values, the online softmax's max or
    sum (prims.prepare_softmax_online, Triton graphs); None for anything else."""
    if is_op(node, aten.sum, aten.amax):
        return node.target.overloadpacket.__name__, node.args[0], list(arg(node, 1, "dim", None) or [])
    if node.target is operator.getitem:
        source, item = node.args
        if is_op(source, aten.max) and len(source.args) > 1 and item == 0:
            return "max", source.args[0], [source.args[1]]
        if is_op(source, prims.prepare_softmax_online):
            return ("online max", "online sum")[item], source.args[0], [source.args[1]]
    return None


def per_row(node: fx.Node, x: fx.Node, kinds: tuple[str, ...]) -> list[fx.Node] | None:
    """The nodes of `node` = a reduction (one of `kinds`) of x over its last dim, shaped [..., 1]
    to broadcast per row (keepdim, or unsqueezed); None if it is not."""
    path = [node]
    while is_op(path[-1], aten.unsqueeze, aten.view, aten.reshape):
        path.append(path[-1].args[0])
    found = reduction(path[-1])
    if (found is None or found[0] not in kinds or found[1] is not x or len(found[2]) != 1
            or not is_last_dim(found[2][0], x) or dims(node) != dims(x)[:-1] + [1]):
        return None
    return path + [a for a in path[-1].args if isinstance(a, fx.Node) and a is not x]  # max.dim / online softmax
