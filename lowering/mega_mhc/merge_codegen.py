"""The merge's generated lines: the gates (pre', post') and Sinkhorn on comb, unrolled over the n
streams as [TILE_T] vectors (the merge is one dependent chain per token, so its instruction count
is its latency)."""

from __future__ import annotations

from .spec import MhcSpec, slot_width

def gate_lines(spec: MhcSpec) -> list[str]:
    """The merge's loads and pre' (inside `if HAS_COEFFS:` of _finish_tile, before the tile is
    published: a fresh collapse needs pre'). The accumulator's columns become [TILE_T] vectors
    m_0 .. m_WIDTH (the projections, then sum X'^2)."""
    width = spec.width()
    slot = slot_width(spec.n)
    bits = (slot - 1).bit_length()
    out = ["# every load first: a load placed after a store waits for that store to issue (the",
           "# compiler cannot tell the two do not alias), so loads interleaved with the stores below",
           "# made this merge a chain of L2 round trips (~4.5 us of a 10 us launch on the H200)",
           "if ACC_COPIES > 1:",
           "    # the gates' biases before the block: loaded after it, they were issued only after the",
           "    # block's transpose (its shared-memory barrier), a second round trip (T=64 8.98 against",
           "    # 9.21 us; at T=1, one copy, this order measured ~0.15 us slower: there they stay last)"]
    biases = [f"b_{c} = tl.load(base_ptr + {c})" for c in range(width)]
    out += ["    " + line for line in biases]
    out += ["    # the tile's block, one [TILE_T, SLOT] load a copy, summed, then split into its columns in",
            "    # registers (tl.split halves the last dimension: even and odd columns). Per-column [TILE_T]",
            "    # loads are issued by every warp of the program alike (each thread holds every token's",
            "    # value): 4x the loads, and T=64 is 9.74 against 9.56 us with them. With one copy they",
            "    # stay: at T=1 most of the block is padding tokens",
            "    # that the masked column loads skip (5.84 against 5.94 us).",
            "    blk_offs = sums[:, None] + tl.arange(0, SLOT)[None, :] * TILE_T",
            "    blk = tl.load(blk_offs)",
            "    for k in tl.static_range(1, ACC_COPIES):",
            "        blk += tl.load(_in_copy(blk_offs, k, TILE_T))"]
    # blk_<b0 b1 ...>: the columns whose low bits are b0, b1, ... (the last level is [TILE_T]);
    # halves no column 0..WIDTH lies in are not split
    paths = {c: "".join(str((c >> b) & 1) for b in range(bits)) for c in range(width + 1)}
    level = [("blk", "")]
    for depth in range(bits):
        cols_left = slot >> (depth + 1)
        halves = []
        for name, path in level:
            shaped = name if cols_left == 1 else f"tl.reshape({name}, [TILE_T, {cols_left}, 2])"
            out.append(f"    blk_{path}0, blk_{path}1 = tl.split({shaped})")
            halves += [(f"blk_{path}{b}", path + b) for b in "01"
                       if any(p.startswith(path + b) for p in paths.values())]
        level = halves
    out += [f"    m_{c} = blk_{path}" for c, path in paths.items()]
    out.append("else:")
    out += [f"    m_{c} = _column_sum(sums + {c} * TILE_T, row_ok, TILE_T, ACC_COPIES)" for c in range(width + 1)]
    out += ["    " + line for line in biases]
    out.append("# r scales the projection instead of the input: one scalar per token, over all n*D values")
    out.append(f"r = tl.rsqrt(m_{width} / ND + STAT_EPS)  # (column {width}: sum X'^2)")
    out.append("# pre' = sigmoid(m * r * scale0 + base) + eps")
    out += [f"tl.store(pre_ptr + rows64 * N + {k}, _sigmoid(m_{k} * r * s_pre + b_{k}, INTERPRETED) + HC_EPS, "
            "mask=row_ok)" for k in range(spec.n)]
    return out


# Sinkhorn's rounds after the first run in a loop of SINKHORN_UNROLL rounds a trip (unrolled in the
# loop body), the remainder unrolled after it: on the H200 at T=64 9.41 against 9.56 us for a loop of
# one round a trip. Unrolling all of them on the cells is faster still but makes each build ~10x
# slower (Triton's coalescing pass); four rounds a trip build in ~2x the time. With the rounds on
# factors (the T=1 and T=64 rows) more unrolling gains nothing (T=64: 4 or 8 rounds a trip alike,
# all 19 slower), and the sm_90 build of all 19 takes 27 s against 7.
SINKHORN_UNROLL = 4


def comb_lines(spec: MhcSpec) -> list[str]:
    """post' and comb' (inside the second `if HAS_COEFFS:` of _finish_tile, after the tile is
    published): Sinkhorn unrolled on [TILE_T] vectors."""
    n = spec.n
    ks = range(n)
    out = ["# post' = 2 sigmoid(m * r * scale1 + base)"]
    out += [f"tl.store(posto_ptr + rows64 * N + {k}, 2.0 * _sigmoid(m_{n + k} * r * s_post + b_{n + k}, "
            "INTERPRETED), mask=row_ok)" for k in ks]
    out.append("# comb logits c_i_j, then Sinkhorn exactly as the reference truncates it: softmax over j")
    out.append("# (+eps), divide by column sums (+eps), then SINKHORN_ITERS-1 rounds of (rows, columns)")
    for i in ks:
        for j in ks:
            c = 2 * n + i * n + j
            out.append(f"c_{i}_{j} = m_{c} * r * s_comb + b_{c}")
    for i in ks:
        row = [f"c_{i}_{j}" for j in ks]
        out.append(f"mx = {_max_expr(row)}")
        for j in ks:
            out.append(f"c_{i}_{j} = _exp(c_{i}_{j} - mx, INTERPRETED)")
        out.append(f"inv = _reciprocal({tree_sum(row)}, INTERPRETED)")
        for j in ks:
            out.append(f"c_{i}_{j} = c_{i}_{j} * inv + HC_EPS")
    out.append("if SINKHORN_FACTORS:")
    out += ["    " + line for line in _factor_rounds(n)]
    out.append("else:")
    out += _normalise_lines(n, "col", 4)
    out.append(f"    for _ in range((SINKHORN_ITERS - 1) // {SINKHORN_UNROLL}):")
    out.append(f"        for _ in tl.static_range({SINKHORN_UNROLL}):")
    out += _normalise_lines(n, "row", 12)
    out += _normalise_lines(n, "col", 12)
    out.append(f"    for _ in tl.static_range((SINKHORN_ITERS - 1) % {SINKHORN_UNROLL}):")
    out += _normalise_lines(n, "row", 8)
    out += _normalise_lines(n, "col", 8)
    for i in ks:
        for j in ks:
            out.append(f"tl.store(combo_ptr + rows64 * (N * N) + {i * n + j}, c_{i}_{j}, mask=row_ok)")
    return out


def _factor_rounds(n: int) -> list[str]:
    """Sinkhorn from the softmax cells c_i_j on, as row factors a_i and column factors b_j of those
    cells, kept fixed (K): the cells after any round are K_ij a_i b_j. The reference's row step
    divides each row by its sum + eps: a_i <- a_i / (a_i (K b)_i + eps), which is 1/a_i <-
    (K b)_i + eps / a_i, one fused multiply-add on the reciprocal kept alongside (ai_i), then one
    reciprocal; (K b)_i is one multiply and n - 1 fused multiply-adds. The columns alike with
    (K^T a)_j. (Two chains added, the first from eps ai_i, shorten the dependent chain from 5 to 3
    operations but take 9 more instructions a round: 57 against 48 on sm_90, and the T=64 merge
    ends no sooner, 1.9 us after the last arrival against 1.8. One chain that starts from eps
    ai_i, 4 dependent operations after b and the same 48 instructions, is slower: T=64 8.37
    against 8.07 us.) A
    half-round is n (n + 1) instructions and n reciprocals, against n (2n + 1) and n for the
    cells; at the end comb = K a b. The first column normalisation starts b (a = 1)."""
    ks = range(n)
    out = []
    for j in ks:
        out.append(f"bi_{j} = {tree_sum([f'c_{i}_{j}' for i in ks])} + HC_EPS")
        out.append(f"b_{j} = _reciprocal(bi_{j}, INTERPRETED)")
    out += [f"a_{i} = b_0 * 0.0 + 1.0" for i in ks]  # (a = 1 / ai = 1: what SINKHORN_ITERS = 1 ends with)
    out += [f"ai_{i} = a_{i}" for i in ks]
    body = []
    for i in ks:
        body.append(f"ai_{i} = {_fma_chain([(f'c_{i}_{j}', f'b_{j}') for j in ks])} + HC_EPS * ai_{i}")
        body.append(f"a_{i} = _reciprocal(ai_{i}, INTERPRETED)")
    for j in ks:
        body.append(f"bi_{j} = {_fma_chain([(f'c_{i}_{j}', f'a_{i}') for i in ks])} + HC_EPS * bi_{j}")
        body.append(f"b_{j} = _reciprocal(bi_{j}, INTERPRETED)")
    out.append(f"for _ in range((SINKHORN_ITERS - 1) // {SINKHORN_UNROLL}):")
    out.append(f"    for _ in tl.static_range({SINKHORN_UNROLL}):")
    out += ["        " + line for line in body]
    out.append(f"for _ in tl.static_range((SINKHORN_ITERS - 1) % {SINKHORN_UNROLL}):")
    out += ["    " + line for line in body]
    out += [f"c_{i}_{j} = c_{i}_{j} * a_{i} * b_{j}" for i in ks for j in ks]
    return out


def _fma_chain(pairs: list[tuple[str, str]]) -> str:
    """x0 * y0 + x1 * y1 + ... as one multiply and a chain of fused multiply-adds."""
    expr = f"{pairs[0][0]} * {pairs[0][1]}"
    for x, y in pairs[1:]:
        expr = f"({expr}) + {x} * {y}"
    return expr


def tree_sum(names: list[str]) -> str:
    """a + b + c + d as ((a + b) + (c + d)): log2(n) dependent additions instead of n - 1."""
    while len(names) > 1:
        names = [f"({a} + {b})" for a, b in zip(names[::2], names[1::2])] + (names[-1:] if len(names) % 2 else [])
    return names[0]


def _max_expr(names: list[str]) -> str:
    expr = names[0]
    for name in names[1:]:
        expr = f"tl.maximum({expr}, {name})"
    return expr


def _normalise_lines(n: int, axis: str, indent: int) -> list[str]:
    """comb / (sum over the other index + eps): `row` sums over j, `col` over i. One division per
    row (a reciprocal), then n multiplications: the Sinkhorn rounds are one thread's dependent
    chain per token, so their instruction count is their latency (x * (1/s) differs from x / s
    by about an ulp). One reciprocal for all n sums (1/s_a = product of the others / product of
    all: 1 special-function issue a half-round instead of n, 16 more instructions a round) is
    slower: T=64 9.24 against 8.85 us, T=1 6.01 against 5.69."""
    pad = " " * indent
    out = []
    for a in range(n):
        cells = [f"c_{a}_{b}" if axis == "row" else f"c_{b}_{a}" for b in range(n)]
        out.append(f"{pad}inv = _reciprocal({tree_sum(cells)} + HC_EPS, INTERPRETED)")
        for cell in cells:
            out.append(f"{pad}{cell} = {cell} * inv")
    return out
