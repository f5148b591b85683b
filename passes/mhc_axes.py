"""Reading the ops of the mHC seam as contractions over atoms (passes/mhc_match.py matches with them).

Every product and GEMM of the seam (the post's C^T X and post * y, the fn projection, the collapse)
is read as what it does to the axes of the tensors it reads (`contract`): each axis of a result is
a list of *atoms*, the source axes it runs over, and a GEMM or a broadcast product pairs atoms and
sums some away. An operand is read down through layout ops and exact converts to the tensor it
views (`trace`), and the axes of the operand follow from the source's (`replay`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from .graph import MKL_LINEAR, aten, arg, dtype, is_convert, is_op, known_less, rank, shape, val

# Ops that move or view a tensor's elements without computing: the matcher reads through them.
LAYOUT = (aten.view, aten._unsafe_view, aten.reshape, aten.unsqueeze, aten.squeeze, aten.permute,
          aten.expand, aten.clone, aten.alias, aten.transpose, aten.t)
GEMMS = (aten.mm, aten.bmm, *MKL_LINEAR)


# ---- axes: what views, GEMMs and broadcast products do to the axes they read -------------------
#
# An axis is a tuple of atoms, the source axes it runs over in row-major order (a flatten merges
# several into one). An atom is (members, size): members are the source axes (node, dim) it is;
# a GEMM or an elementwise product pairs two axes, and the atom then has both as members (an
# expanded size-1 axis is an atom with no members). Size-1 axes are empty: they carry nothing.

def _source_axes(node: fx.Node) -> tuple:
    return tuple(() if size == 1 else ((frozenset({(node, d)}), size),) for d, size in enumerate(shape(node)))


def _regroup(axes: tuple, shape) -> tuple | None:
    """A view's axes: the input's atoms in row-major order, grouped into the new sizes (None if the
    view splits an atom: the result mixes what the matcher tracks)."""
    atoms = [atom for axis in axes for atom in axis]
    out, i = [], 0
    for size in shape:
        group, product = [], 1
        while known_less(product, size) and i < len(atoms):
            group.append(atoms[i])
            product *= atoms[i][1]
            i += 1
        if product != size:
            return None
        out.append(tuple(group))
    return tuple(out) if i == len(atoms) else None


def _forward(op: fx.Node, axes: tuple) -> tuple | None:
    """The axes of `op`'s result from those of its input (op.args[0]); None if it mixes them."""
    if is_convert(op) or is_op(op, aten.clone, aten.alias):
        return axes
    rank_in = len(axes)
    if is_op(op, aten.unsqueeze):
        d = op.args[1] % (rank_in + 1)
        return axes[:d] + ((),) + axes[d:]
    if is_op(op, aten.squeeze):
        dims = op.args[1] if len(op.args) > 1 else range(rank_in)
        dims = {d % rank_in for d in (dims if isinstance(dims, (list, tuple, range)) else [dims])}
        return tuple(a for d, a in enumerate(axes) if d not in dims or shape(op.args[0])[d] != 1)
    if is_op(op, aten.permute):
        return tuple(axes[d % rank_in] for d in op.args[1])
    if is_op(op, aten.transpose, aten.t):
        a, b = (d % rank_in for d in op.args[1:3]) if is_op(op, aten.transpose) else (0, rank_in - 1)
        swapped = list(axes)
        swapped[a], swapped[b] = swapped[b], swapped[a]
        return tuple(swapped)
    out = shape(op)
    if is_op(op, aten.expand):
        lead = len(out) - rank_in
        old = ((),) * lead + axes
        return tuple(a if a or size == 1 else ((frozenset(), size),) for a, size in zip(old, out))
    if is_op(op, aten.view, aten.reshape, aten._unsafe_view):
        return _regroup(axes, out)
    return None


def _unify(a: tuple, b: tuple) -> tuple | None:
    """Two axes paired elementwise (a broadcast product's aligned axes, a GEMM's batch or its
    contracted axes): one axis whose atoms have both as members; None if their sizes differ."""
    if not a or not b:
        return a or b
    if len(a) == len(b) and all(x[1] == y[1] for x, y in zip(a, b)):
        return tuple((x[0] | y[0], x[1]) for x, y in zip(a, b))
    if math.prod(x[1] for x in a) == math.prod(y[1] for y in b):
        return ((frozenset().union(*(x[0] for x in a + b)), math.prod(x[1] for x in a)),)
    return None


def atom_members(axes: tuple) -> list[frozenset]:
    """The atoms of `axes` in order (size-1 axes contribute none)."""
    return [members for axis in axes for members, _ in axis]


def leading_atoms(source: fx.Node, skip: int, *others: fx.Node) -> list[frozenset]:
    """The atoms of `source`'s leading axes (all but its last `skip`), each paired with the same
    axis of `others` (tensors of the seam share their leading, token dims)."""
    sizes = shape(source)
    return [frozenset({(source, d)} | {(o, d) for o in others}) for d in range(len(sizes) - skip) if sizes[d] != 1]


def widens(node) -> bool:
    """A dtype convert that is exact: to the same dtype, or a float widened to fp32 / fp64."""
    if not is_convert(node):
        return False
    src, out = dtype(node.args[0]), dtype(node)
    return src == out or (src is not None and src.is_floating_point and out in (torch.float32, torch.float64)
                          and src.itemsize <= out.itemsize)


def unwiden(node: fx.Node) -> fx.Node:
    """`node` under its exact dtype converts (the parameter a `w.float()` reads)."""
    while widens(node):
        node = node.args[0]
    return node


def widen_path(node: fx.Node) -> list[fx.Node]:
    """The exact converts unwiden passes."""
    path = []
    while widens(node):
        path.append(node)
        node = node.args[0]
    return path


@dataclass
class Traced:
    """An operand read through layout ops and exact converts down to a source tensor."""

    source: fx.Node
    axes: tuple  # of the operand, in atoms of `source`
    path: list[fx.Node]  # the layout ops from the operand down to (not including) the source


def replay(path: list[fx.Node], axes: tuple) -> tuple | None:
    """Axes after the ops of `path` (top first, as trace lists them), from the axes under it."""
    for op in reversed(path):
        axes = _forward(op, axes)
        if axes is None:
            return None
    return axes


def trace(node: fx.Node, want=None, rounding: bool = False) -> Traced | None:
    """Walk down from `node` through layout ops and exact converts (never through a rounding:
    rounding X' to the stream dtype is part of the post, and X' is the rounded tensor, unless
    `rounding`); the source is the lowest node on the way for which `want` holds (default: the
    bottom). The operand's axes follow from the source's."""
    walk = [node]
    while is_op(walk[-1], *LAYOUT) or widens(walk[-1]) or rounding and is_convert(walk[-1]):
        walk.append(walk[-1].args[0])
    picked = [i for i, n in enumerate(walk) if want is None or want(n)]
    if not picked:
        return None
    axes = replay(walk[:picked[-1]], _source_axes(walk[picked[-1]]))
    return None if axes is None else Traced(walk[picked[-1]], axes, walk[:picked[-1]])


@dataclass
class Contraction:
    """A GEMM or a (summed) broadcast product, read as atoms: the operands it reads, the axes of its
    result, the atoms it sums over, and its compute nodes (a chain's, never shared)."""

    operands: list[Traced]
    axes: tuple
    summed: list[frozenset]
    nodes: list[fx.Node]


def gemm_operands(core: fx.Node) -> tuple[fx.Node, fx.Node]:
    # MKL's linear (Inductor's freezing on CPU): (x, packed W, W, bias, batch) computes x @ W^T
    return (core.args[0], core.args[2]) if is_op(core, *MKL_LINEAR) else tuple(core.args[:2])


def contract(core: fx.Node, trace=trace) -> Contraction | None:
    """`core` (a bmm, an mm, MKL's linear, a product, or a sum of a product) as a Contraction;
    `trace(operand)` reads each operand; None if it is none of those or mixes axes."""
    if is_op(core, *GEMMS):
        if is_op(core, *MKL_LINEAR) and core.args[3] is not None:
            return None  # a bias term
        traced = [trace(o) for o in gemm_operands(core)]
        if None in traced:
            return None
        la, ra = traced[0].axes, traced[1].axes
        if is_op(core, *MKL_LINEAR):
            ra = ra[::-1] if len(ra) == 2 else None
        if is_op(core, aten.bmm) and len(la) == len(ra) == 3:
            batch, k = _unify(la[0], ra[0]), _unify(la[2], ra[1])
            axes = (batch, la[1], ra[2])
        elif ra is not None and len(ra) == 2 and len(la) >= 2:
            k, batch = _unify(la[-1], ra[0]), ()
            axes = la[:-1] + (ra[1],)
        else:
            return None
        if k is None or batch is None:
            return None
        return Contraction(traced, axes, [m for m, _ in k], [core])
    if is_op(core, aten.sum) and is_op(core.args[0], aten.mul) and len(core.args) > 1:
        product = contract(core.args[0], trace)
        if product is None:
            return None
        r = len(product.axes)
        dims = {d % r for d in core.args[1]}
        keep = arg(core, 2, "keepdim", False)
        axes = tuple(() if d in dims else a for d, a in enumerate(product.axes) if keep or d not in dims)
        summed = [m for d in sorted(dims) for m, _ in product.axes[d]]
        return Contraction(product.operands, axes, product.summed + summed, product.nodes + [core])
    if is_op(core, aten.mul) and all(isinstance(a, fx.Node) for a in core.args[:2]):
        traced = [trace(o) for o in core.args[:2]]
        if None in traced:
            return None
        la, ra = traced[0].axes, traced[1].axes
        r = max(len(la), len(ra))
        la, ra = ((),) * (r - len(la)) + la, ((),) * (r - len(ra)) + ra
        axes = tuple(_unify(a, b) for a, b in zip(la, ra))
        return None if None in axes else Contraction(traced, axes, [], [core])
    return None


def contraction_at(node: fx.Node, trace=trace) -> Contraction | None:
    """The Contraction under `node`, through the layout ops on top of it (they join its nodes)."""
    walk = [node]
    while is_op(walk[-1], *LAYOUT) or widens(walk[-1]):
        walk.append(walk[-1].args[0])
    found = contract(walk[-1], trace)
    if found is None:
        return None
    found.axes = replay(walk[:-1], found.axes)
    found.nodes += walk[:-1]
    return found if found.axes is not None else None


def lift(node: fx.Node, axes: tuple) -> tuple[fx.Node, tuple, list[fx.Node]]:
    """Up from `node` through the layout ops that are its only reader, one after the other:
    (the last of them, its axes, the ops passed)."""
    chain = []
    while len(node.users) == 1 and is_op(next(iter(node.users)), *LAYOUT):
        user = next(iter(node.users))
        lifted = _forward(user, axes)
        if lifted is None:
            break
        node, axes = user, lifted
        chain.append(user)
    return node, axes, chain


def has_shape(*shapes):
    """A `want` for trace: a node of one of these shapes."""
    shapes = [tuple(s) for s in shapes]  # a list: symbolic sizes do not hash
    return lambda node: rank(node) is not None and any(shape(node) == s for s in shapes)
