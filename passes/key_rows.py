"""Attention keys read as the cache's byte rows: which row format a decode subgraph computes.

The runtime's step gathers each query's keys as cache rows (bytes) and decodes them with plain
torch ops (`model.cache`), `keys = cat(decode(SWA rows), decode(global rows))` along the keys. The
MegaAttention kernel decodes rows itself, tile by tile, so the pass hands it the bytes and the
decoded keys never go to memory. Which format a subgraph decodes is decided by what it computes,
not by how it is spelt: the graph's own ops run on probe rows holding every byte value and must
give exactly the format's decode (`model.cache.named_codec`), so another model's spelling of the
same decode is read too, and a decode that differs anywhere (another scale rule, another nibble
order) is not.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from megafuse.model.cache import named_codec

from .base import NoMatch
from .graph import FLOATS, aten, computes, dims, dtype, is_op, is_size, moves, probe_shape, subgraph, val

# The row formats the kernel decodes (lowering.mega_attention.KEY_FORMATS less "values").
FORMATS = ("swa_fp8", "global_fp4", "raw")
# How far above a decoded segment its rows may be (nodes): a decode is a few dozen ops.
_SEARCH_NODES = 96
# The largest probe (bytes): a static row count (no symbol to bind small) makes the probe as large.
_PROBE_BYTES = 1 << 25


def key_segments(keys: fx.Node, head_dim: int) -> tuple[list[fx.Node], tuple[str, ...], list[fx.Node], list[str]]:
    """(one input per key segment, its format, the nodes from them up to `keys`, notes on decodes
    left outside) where `keys` [rows.., J, head_dim] is the segments joined along J (or one
    segment); ([keys], ("values",), [], notes) where no segment is decoded from cache rows.
    NoMatch(why) where decoded rows cannot be taken in."""
    path = [keys]
    while moves(path[-1]) and _same_but_units(path[-1], path[-1].args[0]):
        path.append(path[-1].args[0])
    joined = path[-1]
    parts = [joined]
    rank = len(dims(joined))
    if is_op(joined, aten.cat) and (joined.args[1] if len(joined.args) > 1 else 0) % rank == rank - 2:
        parts = list(joined.args[0])  # joined along the keys
    found = [_decoded(part, head_dim) for part in parts]
    notes = [f"the keys' decode: segment {i} is computed from uint8 rows {dims(f[0])} by no decode the kernel "
             f"reads ({', '.join(FORMATS)} in {str(dtype(keys)).removeprefix('torch.')})"
             for i, f in enumerate(found) if f is not None and f[1] is None]
    if all(f is None or f[1] is None for f in found):
        return [keys], ("values",), [], notes
    inputs, formats, nodes = [], [], list(path)
    for part, decode in zip(parts, found):
        if dims(part)[:-2] != dims(joined)[:-2]:
            raise NoMatch(f"a key segment {dims(part)} has other rows than the keys {dims(joined)}")
        source, fmt, decode_nodes = decode if decode is not None and decode[1] is not None else (part, "values", [])
        inputs.append(source)
        formats.append(fmt)
        nodes += decode_nodes
    inside = set(nodes)
    for node in nodes:
        if node is not keys and not all(user in inside for user in node.users):
            raise NoMatch(f"{node.name} of the keys' decode is also used elsewhere")
    return inputs, tuple(formats), nodes, notes


def _same_but_units(a: fx.Node, b: fx.Node) -> bool:
    """a and b hold the same [.., J, Dh] values but for unit dims (a [None] of the rows)."""
    return dims(a)[-2:] == dims(b)[-2:] and [d for d in dims(a) if d != 1] == [d for d in dims(b) if d != 1]


def _decoded(part: fx.Node, head_dim: int) -> tuple[fx.Node, str | None, list[fx.Node]] | None:
    """(the rows, their format, the decode's nodes) if `part` [.., J, head_dim] is the decode of
    uint8 rows [.., J, row bytes] of one of FORMATS in part's dtype; (the rows it is computed from,
    None, []) if it decodes them otherwise; None if no rows lie above it."""
    if dtype(part) not in FLOATS:
        return None
    seen, queue, widest, visited = {part}, [part], None, 0
    while queue and visited < _SEARCH_NODES:
        node, visited = queue.pop(0), visited + 1
        if dtype(node) == torch.uint8 and dims(node)[:-1] == dims(part)[:-1]:
            if widest is None or _row_likeness(node, head_dim) > _row_likeness(widest, head_dim):
                widest = node
            fmt = _format_of(node, part, head_dim)
            if fmt is not None:
                needed = subgraph(node, part)
                reached = {node}  # the decode proper: the nodes computed from the rows (not sizes, constants)
                for n in node.graph.nodes:
                    if n in needed and not is_size(n) and any(a in reached for a in n.all_input_nodes):
                        reached.add(n)
                return node, fmt, [n for n in needed if n in reached]
        if node.op != "call_function":
            continue  # a graph input: the rows may be one, nothing lies above it
        for source in node.all_input_nodes:
            if source not in seen and source.op in ("call_function", "placeholder") and not is_size(source):
                seen.add(source)
                queue.append(source)
    return None if widest is None else (widest, None, [])


def _codec(fmt: str, head_dim: int, dtype: torch.dtype):
    """The cache's codec of `fmt` for rows of head_dim values in dtype; None where it has none
    (a head_dim its blocks do not tile, a dtype raw rows do not hold)."""
    try:
        return named_codec(fmt, head_dim, dtype)
    except ValueError:
        return None


def _row_likeness(node: fx.Node, head_dim: int) -> tuple[bool, int]:
    """Orders uint8 tensors by how much they look like whole cache rows: a format's row size first,
    then width (whole rows rather than their slices)."""
    widths = {codec.row_bytes for codec in (_codec(fmt, head_dim, torch.float32) for fmt in FORMATS) if codec}
    return dims(node)[-1] in widths, dims(node)[-1]


def _format_of(rows: fx.Node, part: fx.Node, head_dim: int) -> str | None:
    """The format of FORMATS whose decode `part` computes from `rows` exactly, else None."""
    out = dtype(part)
    shape, sizes = probe_shape(rows)
    n_bytes = 1
    for d in shape:
        n_bytes *= d
    if n_bytes > _PROBE_BYTES:
        raise NoMatch(f"the key rows {dims(rows)} are too many to check their decode on probes (a static row "
                      f"count above {_PROBE_BYTES} bytes; a dynamic one is probed on 2 rows)")
    for fmt in FORMATS:
        codec = _codec(fmt, head_dim, out)
        if codec is None or codec.row_bytes != dims(rows)[-1]:
            continue
        with unset_fake_temporarily():  # a real probe: every byte value, in every position of a row, over the rows
            probe = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        if computes(rows, part, lambda b: codec.decode(b, out), probe, sizes):
            return fmt
    return None
