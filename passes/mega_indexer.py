"""Mega-Indexer: a lightning indexer's step, from the cache's key bytes to its top-k -> the generated
Mega-Indexer kernels (lowering/mega_indexer.py).

Pattern (post-grad ATen graph, anchored at the descending stable `aten.sort` of the top-k), as the
runtime's step writes it (`model.attention.Attention.step`: `index_scores`, `select_topk`):

    rows    = pool[pages].reshape(R, N, B)          the request's pages of key rows, N = pages x P
    keys    = decode(rows)                          model.quant's MXFP4 decode, or the raw codec's bits
    logits  = relu(bmm(q [R, H, d], keys^T))        q.float(), keys.float(): fp32 products
    scores  = bmm(w [R, 1, H], logits) [R, N]       the head weights' sum
    scores  = where(~(n < (positions + 1) // ratio), -inf, scores)
    values, ids = sort(cat(scores, full(-inf, [R, K])), descending, stable)[..., :K]
    ids     = sort(where(values > -inf, ids, beyond))  ascending; beyond >= N
    topk    = where(ids == beyond, -1, ids)

Views, permutes and converts sit between the pieces (the einsums decompose into bmm); the pass
checks through `graph.source_dims` that each operand reaches its bmm with its dims in the order the
maths needs (rows as the batch, heads contracted, then d contracted).

Replacement: `topk, scores = megafuse::mega_indexer(q, w, pool, pages, positions, allowed, ratio, topk,
key_format)` on the
tensors the chain starts from; its reference is `lowering.mega_indexer.reference` (the model's own
functions). The decode is read as `model.quant`'s MXFP4 decode writes it: the low and high nibbles
of the element bytes, e2m1 through `(code & 7)` and the sign bit `code & 8`, the ue8m0 scale bytes as
`byte << 23` reinterpreted as fp32 with 2^-127 for byte 0; or as model.cache's raw codec writes
it (quant "none"): the bytes of each value shifted by 8 i and summed in a wider int, wrapped to
signed, narrowed and reinterpreted as fp32 or bf16. The rows' byte layout then fixes everything
the kernel reads.

The scores may be masked a second time, `where(~allowed, -inf, scores)` with a bool `allowed` of
one value per row and entry (a reindex layer past L/2 scores inside its candidate blocks), and the
visibility-masked scores may be read outside the chain (the candidate source picks its blocks from
them): the op returns them beside the top-k, and those readers read the op's.

Not fused (the reason in the report): keys that are not decoded from cache bytes (the prefill's
keys, a foreign model's float keys), other byte formats, other intermediates used outside the chain,
a top-k spelled otherwise; a `torch.topk` over ReLU-weighted scores (HF's indexer) is named as such.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from . import ops
from .base import Candidate, FusionPass, NoMatch
from .graph import aten, call, dims, dtype, is_convert, is_op, known_less, moves, prims, scalar, size_of, source_dims, \
    strip, under_slices, unpadded, val, walk
from .registry import register

NEG_INF = float("-inf")


def _kw(node: fx.Node, index: int, name: str, default=None):
    return node.kwargs.get(name, node.args[index] if len(node.args) > index else default)


def _only_user(node: fx.Node, what: str) -> fx.Node:
    if len(node.users) != 1:
        raise NoMatch(f"{what} ({node.name}) is used outside the indexer's chain")
    return next(iter(node.users))


def _const(node, what: str) -> float:
    """The value of a scalar constant: a Python number or a 0-dim `aten.full`."""
    value = scalar(node)
    if value is None and is_op(node, aten.full) and list(node.args[0]) == []:
        value = node.args[1]
    if value is None:
        raise NoMatch(f"{what} is not a constant")
    return value


def _sentinel(node):
    """A constant (an int, a 0-dim full) or a size expression (N + K where the entries are symbolic)."""
    if is_op(node, aten.scalar_tensor):
        node = node.args[0]
    if isinstance(node, fx.Node) and isinstance(val(node), torch.SymInt):
        return size_of(val(node))
    return _const(node, "the sentinel of the unselectable indices")


# ---- the top-k: select_topk's spelling ------------------------------------------------------------

def _selection(sort: fx.Node, chain: list) -> tuple[fx.Node, int, fx.Node]:
    """(scores [.., N], K, the output node) of the top-k that the descending stable sort begins."""
    padded = sort.args[0]
    if not is_op(padded, aten.cat) or len(padded.args[0]) != 2 or padded.args[1] not in (-1, len(dims(padded)) - 1):
        raise NoMatch("the sorted scores are not padded with a block of -inf columns (select_topk's spelling)")
    scores, pad = padded.args[0]
    if not is_op(pad, aten.full) or pad.args[1] != NEG_INF:
        raise NoMatch("the scores' padding is not -inf")
    if not _from_a_product(scores):
        raise NoMatch("the sorted values are no indexer's scores (no product under their masks)", candidate=False)
    K = dims(pad)[-1]
    chain += [padded, pad, sort]
    items = {u.args[1]: u for u in sort.users if u.target is operator.getitem}
    if set(items) != {0, 1} or len(sort.users) != 2:
        raise NoMatch("the sort's values and indices are not both read")
    chain += list(items.values())
    top = {}
    for item, node in items.items():
        cut = _only_user(node, "the sorted " + ("values", "indices")[item])
        if not is_op(cut, aten.slice) or _kw(cut, 2, "start", 0) not in (0, None) or _kw(cut, 3, "end") != K:
            raise NoMatch(f"the sorted {('values', 'indices')[item]} are not cut to the first {K}")
        top[item] = cut
        chain.append(cut)
    valid = _only_user(top[0], "the top values")
    if not is_op(valid, aten.gt) or valid.args[1] != NEG_INF:
        raise NoMatch("the top values are not tested against -inf (the selectable entries)")
    kept = _only_user(top[1], "the top indices")
    if not is_op(kept, aten.where) or kept.args[0] is not valid or kept.args[1] is not top[1]:
        raise NoMatch("the unselectable top indices are not replaced by a sentinel")
    beyond = _sentinel(kept.args[2])
    if not known_less(size_of(val(scores).shape[-1]) - 1, beyond):
        raise NoMatch(f"the sentinel {beyond} does not sort after every entry")
    chain += [valid, kept, *([kept.args[2]] if isinstance(kept.args[2], fx.Node) else [])]
    ascending = _only_user(kept, "the selected indices")
    if not is_op(ascending, aten.sort) or _kw(ascending, 2, "descending", False):
        raise NoMatch("the selected indices are not sorted ascending")
    ordered = [u for u in ascending.users if u.target is operator.getitem and u.args[1] == 0]
    if len(ordered) != 1 or len(ascending.users) != 1:
        raise NoMatch("the sorted selection is read otherwise than its values")
    chain += [ascending, ordered[0]]
    users = list(ordered[0].users)
    out = next((u for u in users if is_op(u, aten.where)), None)
    test = out.args[0] if out is not None else None
    if (out is None or not is_op(test, aten.eq) or test.args[0] is not ordered[0]
            or _sentinel(test.args[1]) != beyond or out.args[2] is not ordered[0]
            or _const(out.args[1], "the fill of unselected slots") != -1 or set(users) != {out, test}):
        raise NoMatch("the sentinel is not replaced by -1 in the output")
    chain += [test, out, *[a for a in (out.args[1], test.args[1]) if isinstance(a, fx.Node)]]
    return scores, K, out


# ---- the scores ------------------------------------------------------------------------------------

def _is_neg_inf_mask(node) -> bool:
    """node = where(mask, -inf, x): a masked_fill of -inf."""
    if not is_op(node, aten.where):
        return False
    fill = node.args[1]
    return scalar(fill) == NEG_INF or is_op(fill, aten.full) and list(fill.args[0]) == [] and fill.args[1] == NEG_INF


def _from_a_product(scores: fx.Node) -> bool:
    """scores, under at most two -inf masks, come from a batched product: what tells an indexer's
    top-k from other sorts (a candidate source's block selection sorts block maxima)."""
    for _ in range(2):
        if _is_neg_inf_mask(scores):
            scores = scores.args[2]
    return is_op(under_slices(walk(scores)[-1])[0], aten.bmm)


def _relu_scores(scores: fx.Node, depth: int = 6) -> bool:
    """scores, under -inf masks, weigh and sum a ReLU within `depth` ops: a lightning indexer's."""
    while _is_neg_inf_mask(scores):
        scores = scores.args[2]
    frontier = [scores]
    for _ in range(depth):
        if any(is_op(n, aten.relu) for n in frontier):
            return True
        frontier = [a for n in frontier for a in n.all_input_nodes
                    if moves(a) or is_convert(a)
                    or is_op(a, aten.relu, aten.mul, aten.sum, aten.bmm, aten.mm, aten.expand)]
    return False


def _allowed(mask: fx.Node, shape: list, chain: list) -> fx.Node:
    """The bool tensor of mask = ~allowed, holding one value per row and entry."""
    if not is_op(mask, aten.bitwise_not) or dtype(mask.args[0]) != torch.bool:
        raise NoMatch("the scores' second mask is not ~(a bool tensor of the allowed entries)")
    allowed = mask.args[0]
    if dims(allowed) != shape:
        raise NoMatch(f"the allowed entries {dims(allowed)} are not one per row and entry {shape}")
    chain.append(mask)
    return allowed

def _visibility(mask: fx.Node, n_entries, chain: list) -> tuple[fx.Node, int]:
    """(positions [R], ratio) of mask = ~(arange(N) < (positions + 1) // ratio), broadcast."""
    if not is_op(mask, aten.bitwise_not):
        raise NoMatch("the scores are not masked by the entries' visibility")
    chain.append(mask)
    lt = mask.args[0]
    while is_op(lt, aten.unsqueeze, aten.view, aten.reshape, aten.expand):
        chain.append(lt)
        lt = lt.args[0]
    if not is_op(lt, aten.lt):
        raise NoMatch("the visibility is not entry < (position + 1) // ratio")
    entry, bound = lt.args
    entry_path, bound_path = walk(entry), walk(bound)
    iota, div = entry_path[-1], bound_path[-1]
    if not is_op(iota, prims.iota) or size_of(val(iota).shape[0]) != n_entries or iota.kwargs.get("start", 0) != 0 \
            or iota.kwargs.get("step", 1) != 1:
        raise NoMatch(f"the visible entries are not counted over arange({n_entries})")
    if not is_op(div, aten.div) or div.kwargs.get("rounding_mode") != "floor" or scalar(div.args[1]) is None:
        raise NoMatch("the visible count is not (position + 1) // ratio")
    add = div.args[0]
    if not is_op(add, aten.add) or scalar(add.args[1]) != 1:
        raise NoMatch("the visible count is not (position + 1) // ratio")
    positions, _ = strip(add.args[0], converts=False)
    while is_op(positions, aten.unsqueeze):
        chain.append(positions)
        positions = positions.args[0]
    chain += [lt, *entry_path, *bound_path, add]
    return positions, int(div.args[1])


def _holds(path: list[fx.Node], want: list[int], what: str) -> None:
    """The top of `path` holds its source's dims `want` (of those larger than one) in that order."""
    sizes = dims(path[-1])
    if source_dims(path) != [d for d in want if sizes[d] != 1]:
        raise NoMatch(f"{what}: the dims do not reach their product in the order the sum needs")


def _product(node: fx.Node, want: list[int], what: str, chain: list) -> tuple[fx.Node, fx.Node]:
    """The operands of the bmm `node` walks down to (its GPU padding seen through: the output's
    slices and the operands' zero pads), `node` holding the bmm's dims `want` in order."""
    path = walk(node)
    bmm, slices = under_slices(path[-1])
    if not is_op(bmm, aten.bmm):
        raise NoMatch(f"{what} is not a batched product")
    _holds(path, want, what)  # a slice keeps its input's dims and their order
    chain += path + slices[1:] + [bmm] + [a for a in bmm.args if unpadded(a) is not a]
    return unpadded(bmm.args[0]), unpadded(bmm.args[1])


def _source(node: fx.Node, what: str, chain: list) -> fx.Node:
    """The tensor `node` walks down to, holding all its dims larger than one in their order."""
    path = walk(node)
    _holds(path, list(range(len(dims(path[-1])))), what)
    chain += path[:-1]
    return path[-1]


# ---- the keys: model.quant's MXFP4 decode of the gathered rows ---------------------------------

def _mxfp4_rows(keys: fx.Node, chain: list) -> fx.Node:
    """The gathered byte rows [R, N, B] that `keys` decodes (raises NoMatch naming the difference)."""
    mul = keys
    while is_op(mul, aten.view, aten.reshape) or is_convert(mul):
        chain.append(mul)
        mul = mul.args[0]
    if not is_op(mul, aten.mul):
        raise NoMatch("the keys are not decoded from the cache's bytes (no block scale multiplies them)")
    values, scale = (strip(a, converts=False)[0] for a in mul.args)
    chain += [mul, *strip(mul.args[0], converts=False)[1], *strip(mul.args[1], converts=False)[1]]
    if is_op(values, aten.unsqueeze):
        values, scale = scale, values
    if not is_op(scale, aten.unsqueeze):
        raise NoMatch("the keys' block scales are not broadcast over their blocks")
    chain.append(scale)
    scale_rows = _ue8m0(scale.args[0], chain)
    value_rows = _e2m1(values, chain)
    if scale_rows is not value_rows:
        raise NoMatch("the key's values and scales are read from different rows")
    return value_rows


def _ue8m0(node: fx.Node, chain: list) -> fx.Node:
    """rows of node = where(e == 0, 2^-127, (e << 23).view(float32)), e = int32(rows[..., d/2:])."""
    if not (is_op(node, aten.where) and is_op(node.args[0], aten.eq) and scalar(node.args[0].args[1]) == 0
            and is_op(node.args[1], aten.full) and node.args[1].args[1] == 2.0 ** -127
            and node.args[2].target is aten.view.dtype and is_op(node.args[2].args[0], aten.__lshift__)
            and scalar(node.args[2].args[0].args[1]) == 23):
        raise NoMatch("the keys' scales are not ue8m0 bytes (2^(e - 127), 2^-127 for byte 0)")
    e = node.args[0].args[0]
    if node.args[2].args[0].args[0] is not e or not is_convert(e) or not is_op(e.args[0], aten.slice):
        raise NoMatch("the keys' scale bytes are not a slice of their rows")
    chain += [node, node.args[0], node.args[1], node.args[2], node.args[2].args[0], e, e.args[0]]
    return e.args[0].args[0]


def _e2m1(node: fx.Node, chain: list) -> fx.Node:
    """rows of node = model.quant's e2m1 values of the element bytes' nibbles."""
    error = NoMatch("the keys' elements are not e2m1 codes (magnitude of code & 7, sign of code & 8)")
    signed = node
    if not (is_op(signed, aten.where) and is_op(signed.args[1], aten.neg) and signed.args[1].args[0] is signed.args[2]):
        raise error
    sign, magnitude = signed.args[0], signed.args[2]
    if not (is_op(sign, aten.ne) and is_op(sign.args[0], aten.bitwise_and) and scalar(sign.args[0].args[1]) == 8):
        raise error
    code = sign.args[0].args[0]
    chain += [signed, signed.args[1], sign, sign.args[0]]
    c = _magnitude(magnitude, chain)
    if not (is_convert(c) and is_op(c.args[0], aten.bitwise_and) and scalar(c.args[0].args[1]) == 7
            and c.args[0].args[0] is code):
        raise error
    chain += [c, c.args[0]]
    return _nibbles(code, chain)


def _magnitude(node: fx.Node, chain: list) -> fx.Node:
    """c of where(c < 4, c * 0.5, where(c < 6, c - 2, c * 2 - 8)): model.quant's e2m1 magnitudes."""
    try:
        low_test, low, high = node.args
        mid_test, mid, top = high.args
        c = low_test.args[0]
        ok = (is_op(node, aten.where) and is_op(high, aten.where) and is_op(low_test, aten.lt)
              and scalar(low_test.args[1]) == 4 and is_op(mid_test, aten.lt) and mid_test.args[0] is c
              and scalar(mid_test.args[1]) == 6 and is_op(low, aten.mul) and low.args[0] is c
              and scalar(low.args[1]) == 0.5 and is_op(mid, aten.sub) and mid.args[0] is c
              and scalar(mid.args[1]) == 2 and is_op(top, aten.sub) and scalar(top.args[1]) == 8
              and is_op(top.args[0], aten.mul) and top.args[0].args[0] is c and scalar(top.args[0].args[1]) == 2)
    except (AttributeError, ValueError, IndexError):
        ok = False
    if not ok:
        raise NoMatch("the keys' e2m1 magnitudes are not model.quant's (0.5 c below 4, c - 2 below 6, 2 c - 8)")
    chain += [node, high, low_test, low, mid_test, mid, top, top.args[0]]
    return c


def _nibbles(code: fx.Node, chain: list) -> fx.Node:
    """rows of code = cat(byte & 15, byte >> 4) per element byte, byte = rows[..., :d/2]."""
    error = NoMatch("the keys' codes are not the low then the high nibble of each element byte")
    if not is_op(code, aten.view, aten.reshape) or not is_op(code.args[0], aten.cat):
        raise error
    parts = [p.args[0] if is_op(p, aten.unsqueeze) else p for p in code.args[0].args[0]]
    if len(parts) != 2 or not (is_op(parts[0], aten.bitwise_and) and scalar(parts[0].args[1]) == 15
                               and is_op(parts[1], aten.__rshift__) and scalar(parts[1].args[1]) == 4
                               and parts[0].args[0] is parts[1].args[0] and is_op(parts[0].args[0], aten.slice)):
        raise error
    chain += [code, code.args[0], *parts, parts[0].args[0], *code.args[0].args[0]]
    return parts[0].args[0].args[0]


def _raw_rows(keys: fx.Node, chain: list) -> fx.Node:
    """The gathered byte rows that `keys` (a view.dtype) reads as little-endian raw bits: model.cache's
    raw codec, sum_i byte_i << 8i in a wider int, wrapped to signed, the int reinterpreted."""
    error = NoMatch("the keys are not the raw codec's little-endian bits (sum of byte << 8 i, wrapped to signed)")
    bits = torch.finfo(dtype(keys)).bits if dtype(keys) in (torch.float32, torch.bfloat16) else 0
    narrow = keys.args[0]
    signed = narrow.args[0] if is_convert(narrow) else None
    if not bits or not is_op(signed, aten.where) or not is_op(signed.args[0], aten.ge):
        raise error
    unsigned = signed.args[2]
    if not (signed.args[0].args[0] is unsigned and scalar(signed.args[0].args[1]) == 2 ** (bits - 1)
            and is_op(signed.args[1], aten.sub) and signed.args[1].args[0] is unsigned
            and scalar(signed.args[1].args[1]) == 2 ** bits and is_op(unsigned, aten.sum)
            and list(unsigned.args[1]) in ([-1], [len(dims(unsigned.args[0])) - 1])):
        raise error
    shifted = unsigned.args[0]
    if not is_op(shifted, aten.__lshift__) or not is_convert(shifted.args[0]) or not is_op(shifted.args[1], prims.iota):
        raise error
    shifts = shifted.args[1]
    width = bits // 8
    if shifts.args[0] != width or shifts.kwargs.get("start", 0) != 0 or shifts.kwargs.get("step", 1) != 8 \
            or dims(shifted.args[0])[-1] != width:
        raise error
    chain += [keys, narrow, signed, signed.args[0], signed.args[1], unsigned, shifted, shifted.args[0], shifts]
    return shifted.args[0].args[0]


def _gathered_pages(rows: fx.Node, chain: list) -> tuple[fx.Node, fx.Node]:
    """(pool [pages, P, B], pages [R, M]) of rows = pool[pages] reshaped to rows of bytes."""
    while is_op(rows, aten.view, aten.reshape) and is_op(rows.args[0], aten.view, aten.reshape):
        chain.append(rows)
        rows = rows.args[0]
    if not is_op(rows, aten.view, aten.reshape) or not is_op(rows.args[0], aten.index):
        raise NoMatch("the key bytes are not the rows of the request's pages (pool[pages], flattened)")
    gather = rows.args[0]
    pool, indices = gather.args
    if len(indices) != 1 or dtype(pool) != torch.uint8 or len(dims(pool)) != 3 or len(dims(indices[0])) != 2:
        raise NoMatch("the key bytes are not gathered by whole pages of a [pages, P, B] uint8 pool")
    chain += [rows, gather]
    return pool, indices[0]


@register
class MegaIndexerPass(FusionPass):
    name = "mega_indexer"
    description = ("lightning indexer step: MXFP4 index keys from the cache + logits + ReLU + head weights + "
                   "visibility + top-k in one generated kernel family")
    op = "megafuse::mega_indexer"
    run_order = 50

    def anchors(self, graph: fx.Graph):
        return [n for n in graph.nodes if is_op(n, aten.topk) or (
            is_op(n, aten.sort) and _kw(n, 2, "descending", False)
            and n.kwargs.get("stable", n.args[1] if len(n.args) > 1 and isinstance(n.args[1], bool) else False))]

    def match(self, sort: fx.Node) -> Candidate:
        if is_op(sort, aten.topk):  # an indexer's top-k spelled as torch.topk (HF's) is named, a gate's is not
            if not _relu_scores(sort.args[0]):
                raise NoMatch("the top-k reads no indexer's scores (no ReLU under them)", candidate=False)
            raise NoMatch("the top-k is torch.topk (ties in no set order, descending), not select_topk's stable "
                          "sort; such an indexer also computes its keys in the forward, not from the cache's bytes")
        chain: list[fx.Node] = []
        # 1. The top-k and the scores it reads: masked by the visibility, and maybe by an allowed mask.
        masked, K, out = _selection(sort, chain)
        if not _is_neg_inf_mask(masked):
            raise NoMatch("the scores the top-k reads are not masked with -inf", candidate=False)
        n_entries = dims(masked)[-1]
        allowed = None
        if _is_neg_inf_mask(masked.args[2]):  # where(~allowed, -inf, where(~visible, -inf, scores))
            allowed = _allowed(masked.args[0], dims(masked), chain)
            chain.append(masked)
            masked = masked.args[2]
        positions, ratio = _visibility(masked.args[0], size_of(val(masked).shape[-1]), chain)
        chain.append(masked)
        scores = masked.args[2]
        published = masked if allowed is None else None  # the candidate source picks its blocks from them
        # 2. scores = bmm(w [R, 1, H], relu(logits) [R, H, N]), logits = bmm(q [R, H, d], keys^T [R, d, N]).
        w_side, relu_side = _product(scores, [0, 2], "the scores", chain)
        w = _source(w_side, "the head weights", chain)
        relu_path = walk(relu_side)
        relu = relu_path[-1]
        if not is_op(relu, aten.relu):
            raise NoMatch("the head weights do not multiply relu(logits)")
        _holds(relu_path, list(range(len(dims(relu)))), "relu(logits)")
        chain += relu_path
        try:
            q_side, keys_side = _product(relu.args[0], [0, 1, 2], "the logits", chain)
        except NoMatch:
            raise NoMatch("the logits are not one row of keys per query row (a prefill's keys, shared by a "
                          "sequence's queries, are not fused)") from None
        q = _source(q_side, "the queries", chain)
        R, H, d = val(q_side).shape
        # 3. The keys: the MXFP4 decode of the request's pages of the pool.
        keys_path = walk(keys_side)
        if keys_path[-1].target is aten.view.dtype:  # raw rows: the bits reinterpreted
            key_format = str(dtype(keys_path[-1])).removeprefix("torch.")
        else:
            cut = next((i for i, n in enumerate(keys_path[:-1]) if is_op(n, aten.view, aten.reshape)
                        and is_op(keys_path[i + 1], aten.mul)), None)
            if cut is None:
                raise NoMatch("the keys are not decoded from the cache's bytes (neither MXFP4 rows nor raw bits)")
            keys_path, key_format = keys_path[:cut + 1], "index_mxfp4"
        _holds(keys_path, [0, 2, 1], "the keys")
        if any(is_convert(n) and dtype(n) not in (torch.float32, torch.bfloat16) for n in keys_path) or (
                key_format == "float32" and any(is_convert(n) and dtype(n) != torch.float32 for n in keys_path)):
            raise NoMatch("the decoded keys are rounded to a dtype that does not hold every value")
        chain += keys_path[:-1]
        rows = _mxfp4_rows(keys_path[-1], chain) if key_format == "index_mxfp4" else _raw_rows(keys_path[-1], chain)
        pool, pages = _gathered_pages(rows, chain)
        pool_pages, per_page, _ = dims(pool)
        if not all(isinstance(size, int) for size in (H, d, per_page, dims(pages)[-1])):
            raise NoMatch(f"the heads, dims, entries a page and pages a row ({H}, {d}, {per_page}, {dims(pages)[-1]}) "
                          "must be static: the kernel is generated for them")
        rows_of = dims(q_side)[0]
        if dims(pages)[0] != rows_of or dims(positions) != [rows_of]:
            raise NoMatch(f"the pages {dims(pages)} and positions {dims(positions)} are not one per query row "
                          f"({rows_of})")
        if isinstance(n_entries, int) and isinstance(dims(pages)[1], int) and n_entries != dims(pages)[1] * per_page:
            raise NoMatch(f"the {n_entries} scored entries are not the pages' {dims(pages)[1]} x {per_page}")
        # 4. Everything but the outputs (the top-k, the masked scores) must be private to the chain.
        inside = set(chain)
        nodes = [n for n in sort.graph.nodes if n in inside]
        for node in nodes:
            if node not in (out, published) and not all(user in inside for user in node.users):
                raise NoMatch(f"intermediate {node.name} is also used outside the indexer's chain")
        spec = ops.indexer_spec(val(q).reshape(-1, H, d), val(pool), allowed, ratio, K, key_format)
        return Candidate(sort, nodes, spec, inputs=dict(q=q, w=w, pool=pool, pages=pages, positions=positions,
                                                        allowed=allowed),
                         outputs={"out": out, "scores": published})

    def check(self, candidate: Candidate) -> str | None:
        i, spec = candidate.inputs, candidate.spec
        q, w, pool, pages, positions = (val(i[n]) for n in ("q", "w", "pool", "pages", "positions"))
        allowed = None if i["allowed"] is None else val(i["allowed"]).reshape(-1, pages.shape[-1] * pool.shape[1])
        return ops.indexer_unsupported(q.reshape(-1, spec.heads, spec.head_dim), w.reshape(-1, spec.heads).float(), pool,
                                       pages.reshape(-1, pages.shape[-1]), positions.reshape(-1), allowed,
                                       *ops.indexer_scalars(spec))

    def rewrite(self, graph: fx.Graph, candidate: Candidate) -> fx.Node:
        spec, inputs, outputs = candidate.spec, candidate.inputs, candidate.outputs
        H, d, M = spec.heads, spec.head_dim, dims(inputs["pages"])[-1]
        shapes = {"q": [-1, H, d], "w": [-1, H], "pool": None, "pages": [-1, M], "positions": [-1],
                  "allowed": [-1, M * spec.per_page]}
        with graph.inserting_before(candidate.anchor):
            args = []
            for name, shape in shapes.items():
                node = inputs[name]
                if node is not None and shape is not None:
                    node = call(graph, aten.reshape.default, (node, shape), val(node).reshape(shape))
                args.append(node)
            if dtype(args[1]) != torch.float32:
                args[1] = call(graph, prims.convert_element_type.default, (args[1], torch.float32), val(args[1]).float())
            args = (*args, *ops.indexer_scalars(spec))
            fused = call(graph, torch.ops.megafuse.mega_indexer.default, args,
                         ops.indexer_fake(*(val(a) for a in args)))
            for item, name in enumerate(("out", "scores")):
                old = outputs[name]
                if old is None:
                    continue
                part = call(graph, operator.getitem, (fused, item), val(fused)[item])
                shape = [s if isinstance(s, int) else -1 for s in dims(old)]  # the chain's own leading dims
                new = call(graph, aten.reshape.default, (part, shape), val(part).reshape(val(old).shape))
                old.replace_all_uses_with(new)
        fused.meta["stack_trace"] = candidate.anchor.meta.get("stack_trace")
        return fused
