"""graph.zero_or_below, the proof that lets MegaAttention read a float mask as `mask == 0`: on masks
built from random recipes of fills, where, scatter, cat, add, slices and casts (traced to ATen as
Inductor decomposes them), a mask it proves holds only 0 and values at or below the floor on every
random input (soundness), and every recipe of 0 and -inf pieces is proven (what it must read)."""

import math

import torch
from hypothesis import given, settings, strategies as st
from torch.fx.experimental.proxy_tensor import make_fx
from torch._inductor.decomposition import select_decomp_table

from megafuse.passes.graph import zero_or_below

FLOOR = -1e30
REMOVING = (0.0, -math.inf, -1e30, -3.0e38)  # 0 keeps a key, the rest remove it
OTHER = (1.0, -0.5, -1e29)  # finite values above the floor: a bias, not a mask
SHAPE = (2, 3, 4)


def recipes(values, bias: bool = False):
    """Trees of (op, ...) building a [2, 3, 4] fp32 tensor from fills of `values`, the condition and
    the indices, and (`bias`) a float input the graph knows nothing of."""
    leaf = st.one_of(st.tuples(st.just("full"), st.sampled_from(values)), st.just(("zeros",)),
                     *([st.just(("bias",))] if bias else []))
    return st.recursive(leaf, lambda inner: st.one_of(
        st.tuples(st.just("where"), inner, inner),
        st.tuples(st.just("scatter"), st.sampled_from(values), st.sampled_from(values)),
        st.tuples(st.just("cat"), inner, inner),
        st.tuples(st.just("add"), inner, inner),
        st.tuples(st.just("bf16"), inner),
        st.tuples(st.just("expand"), inner)), max_leaves=6)


def build(recipe, cond, idx, bias):
    op, *args = recipe
    if op == "full":
        return torch.full(SHAPE, args[0])
    if op == "zeros":
        return torch.zeros(SHAPE)
    if op == "bias":
        return bias
    if op == "where":
        return torch.where(cond, build(args[0], cond, idx, bias), build(args[1], cond, idx, bias))
    if op == "scatter":  # HF's block bias: a fill with another value scattered at picked entries, cut back
        return torch.full((2, 3, 5), args[0]).scatter(-1, idx, args[1])[..., :4]
    if op == "cat":
        return torch.cat([build(args[0], cond, idx, bias)[..., :2], build(args[1], cond, idx, bias)[..., 2:]], -1)
    if op == "add":
        return build(args[0], cond, idx, bias) + build(args[1], cond, idx, bias)
    if op == "bf16":
        return build(args[0], cond, idx, bias).to(torch.bfloat16).float()
    return build(args[0], cond, idx, bias)[:1].expand(SHAPE)  # "expand"


def proven(recipe) -> bool:
    inputs = _inputs(0)
    graph = make_fx(lambda c, i, b: build(recipe, c, i, b), decomposition_table=select_decomp_table())(*inputs)
    out = next(n for n in graph.graph.nodes if n.op == "output").args[0]
    return zero_or_below(out[0] if isinstance(out, (tuple, list)) else out, FLOOR)


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(SHAPE, generator=g) < 0.5, torch.randint(0, 5, (2, 3, 2), generator=g),
            torch.randn(SHAPE, generator=g))


def _holds(t: torch.Tensor) -> bool:
    return bool(((t == 0) | (t <= FLOOR)).all())


@settings(max_examples=60, deadline=None)
@given(recipes(REMOVING + OTHER, bias=True))
def test_a_proven_mask_holds_only_zero_and_removals_on_every_input(recipe):
    if proven(recipe):
        for seed in range(4):
            assert _holds(build(recipe, *_inputs(seed))), recipe


@settings(max_examples=40, deadline=None)
@given(recipes(REMOVING))
def test_every_mask_of_zeros_and_removals_is_proven(recipe):
    assert proven(recipe), recipe


def test_a_bias_or_a_finite_fill_is_not_proven():
    assert not proven(("add", ("zeros",), ("bias",)))
    assert not proven(("where", ("zeros",), ("full", -0.5)))
    assert not proven(("scatter", -math.inf, 1.0))
    assert proven(("cat", ("where", ("zeros",), ("full", -math.inf)), ("scatter", -math.inf, 0.0)))
