"""MhcSpec -> the Triton module's source, its content key, its cache file and its loaded kernels.

The kernel is one template (template_* pieces, joined in order) filled per spec: the n streams,
the sub-tiles and the merge's Sinkhorn are unrolled here, so the Triton code is elementwise on
register tiles. One source serves both Triton modes (compiled for CUDA tensors, interpreted for
CPU tensors).
"""

from __future__ import annotations

import dataclasses
import hashlib
import string

from .. import kernel_cache
from .merge_codegen import comb_lines, gate_lines, tree_sum
from .spec import (HANDOFF_SHIFT, LEAVE_OUT_PARTS, SUB_SUFFIX, TRACE_EVENTS, TRACE_ROLES, MhcSpec, slot_width,
                   unsupported_reason)
from .template_epilogue import EPILOGUE
from .template_kernel import KERNEL
from .template_prelude import PRELUDE, PROJECT_BF16, PROJECT_FP32
from .template_stage_a import CHUNK_BODY, STAGE_A, SUB_BODY

KERNEL_NAME = "mega_mhc_kernel"
TEMPLATE = string.Template(PRELUDE + STAGE_A + EPILOGUE + KERNEL)


def fmt_float(x: float) -> str:
    """A Python literal that round-trips to the same float (repr is exact for Python floats)."""
    return repr(float(x))




def _constants(spec: MhcSpec) -> str:
    width = spec.width()
    rows = [
        ("N", spec.n, "residual streams"),
        ("D", spec.dim, "hidden size"),
        ("ND", spec.n * spec.dim, "n*D: the width of the coefficient statistic and of fn's rows"),
        ("WIDTH", width, "(2+n)n rows of fn: [pre n | post n | comb n*n]"),
        ("SLOT", slot_width(spec.n), "accumulator row / projection width: power of two >= WIDTH + 2"),
        ("SUMSQ_COL", width, "accumulator column: sum of X'^2 (all streams)"),
        ("CSQ_COL", width + 1, "accumulator column: sum of c^2"),
        ("SINKHORN_ITERS", spec.sinkhorn_iters, ""),
        ("HC_EPS", fmt_float(spec.hc_eps), ""),
        ("STAT_EPS", fmt_float(spec.stat_eps), "eps of the coefficient statistic mean(X'^2)"),
        ("NORM_EPS", fmt_float(spec.norm_eps), "eps of the sublayer RMSNorm"),
        ("NORM_ROUNDS_TWICE", spec.norm_rounding == "twice", "u = round(round(c * r) * weight), not round(c * r * weight)"),
        ("HAS_POST", spec.has_post, "apply the previous sublayer's post (else X' = X)"),
        ("HAS_COEFFS", spec.has_coefficients, "compute pre', post', comb' of the next site"),
        ("FRESH", spec.pre == "fresh", "collapse with pre' (V4) instead of the carried pre (V4.1)"),
        ("IS_BF16", spec.stream_dtype == "bfloat16",
         "stream dtype bf16 (else fp16)" if spec.stream_dtype == "float16" else "stream dtype bf16 (else fp32)"),
    ]
    lines = []
    for name, value, comment in rows:
        code = f"{name} = tl.constexpr({value})"
        lines.append(f"{code:<36}# {comment}" if comment else code)
    return "\n".join(lines)


def generate_source(spec: MhcSpec) -> str:
    """The Triton module for `spec` (raises ValueError for an unsupported spec)."""
    reason = unsupported_reason(spec)
    if reason:
        raise ValueError(f"mega_mhc cannot generate this spec: {reason}")
    return _render(spec, spec.key())


def source_key(spec: MhcSpec) -> str:
    """The content key of `spec`'s module: a hash of its source (rendered with an empty key), so
    any change to the generated text is a new key and a new cache file. An unsupported spec, which
    has no source, hashes its fields (the pass report still names it)."""
    if unsupported_reason(spec):
        text = "unsupported " + repr(dataclasses.astuple(spec))
    else:
        text = _render(spec, "")
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _render(spec: MhcSpec, key: str) -> str:
    """The module's source (of a supported spec) with `key` in its docstring."""
    n = spec.n
    streams = range(n)
    lines = {}

    def block(name, indent, rows):
        lines[name] = "\n".join(" " * indent + r for r in rows)

    def step(k, stride):  # pointer offset of stream k
        return "" if k == 0 else f" + {k} * {stride}"

    # what _load_streams / _load_chunk return, and the loop's current / next names for them
    bf16, fp16 = spec.stream_dtype == "bfloat16", spec.stream_dtype == "float16"
    pieces = [[f"fa_{k}", f"fb_{k}"] if bf16 else [f"w_{k}"] for k in streams]  # fn's block per stream
    fn_names = [name for names in pieces for name in names] if spec.has_coefficients else []

    def stream_names(sfx):
        return (["y" + sfx] if spec.has_post else []) + [f"x_{k}{sfx}" for k in streams]

    load = []
    if spec.has_post:
        load.append("y = tl.load(y_ptr + rows64[:, None] * stride_yt + d[None, :], mask=ok, other=0.0, "
                    "eviction_policy=\"evict_first\")")
    load += [f"x_{k} = tl.load(x_ptrs{step(k, 'stride_xk')}, mask=ok, other=0.0, eviction_policy=\"evict_first\")"
             for k in streams]
    load.append("return " + ", ".join(stream_names("")))
    block("STREAM_LOAD_LINES", 4, load)
    load = [", ".join(stream_names("")) + " = _load_streams(",
            "    x_ptr, y_ptr, rows64, row_ok, stride_xt, stride_xk, stride_yt, chunk, c_end, BLOCK_D)"]
    if spec.has_coefficients:
        load.append("# fn^T's block for each stream: rows d of stream k, columns 0..SLOT (past WIDTH: zeros)")
        load.append("fcols = tl.arange(0, SLOT)")
        fn_block = "fcols[None, :].to(tl.int64) * ND + (d + {k} * D)[:, None]"
        load.append("f_ok = ((d < D) & live)[:, None] & (fcols < WIDTH)[None, :]")
        zeros = "tl.full([BLOCK_D, SLOT], 0.0, dtype=tl.{})"
        if bf16:
            # timing diagnostic (leave_out): zeros of the dtype the load would give, nothing read
            for branch, dtype in (("if (LEAVE_FN_LOADS & LEAVE_OUT) and PRESPLIT:", "bfloat16"),
                                  ("elif LEAVE_FN_LOADS & LEAVE_OUT:", "float32")):
                load.append(branch)
                for k in streams:
                    load += [f"    fa_{k} = {zeros.format(dtype)}", f"    fb_{k} = fa_{k}"]
            load.append("elif PRESPLIT:  # fn's pieces, given to the launch (split_fn)")
            for k in streams:
                load.append(f"    fa_{k} = tl.load(fns_ptr + {fn_block.format(k=k)}, mask=f_ok, other=0.0)")
                load.append(f"    fb_{k} = tl.load(fns_ptr + SLOT * ND + {fn_block.format(k=k)}, mask=f_ok, other=0.0)")
            load.append("else:  # the fp32 block, split by _project")
            for k in streams:
                load.append(f"    fa_{k} = tl.load(fn_ptr + {fn_block.format(k=k)}, mask=f_ok, other=0.0)")
                load.append(f"    fb_{k} = fa_{k}")
        else:
            load.append("if LEAVE_FN_LOADS & LEAVE_OUT:  # timing diagnostic: nothing read")
            load += [f"    w_{k} = {zeros.format('float32')}" for k in streams]
            load.append("else:")
            load += [f"    w_{k} = tl.load(fn_ptr + {fn_block.format(k=k)}, mask=f_ok, other=0.0)" for k in streams]
    loaded = stream_names("") + fn_names
    load.append("return " + ", ".join(loaded))
    block("LOAD_LINES", 4, load)
    lines["STREAM_LOAD_DOC"] = ", ".join((["y"] if spec.has_post else []) + ["the n streams"])
    lines["LOAD_DOC"] = lines["STREAM_LOAD_DOC"] + (", fn^T's block per stream" if spec.has_coefficients else "")
    lines["CUR_NAMES"] = ", ".join(loaded)
    lines["CUR_NAMES_S1"] = ", ".join(stream_names(SUB_SUFFIX[1]))
    lines["NEXT_NAMES"] = ", ".join(f"{name}_n" for name in loaded)

    def sub_rows(sfx: str, first_row: str) -> list[str]:
        """One sub-tile's rows and zeroed partial sums: no memory access (before _begin)."""
        out = [f"rows{sfx} = tile * TILE_T + {first_row}tl.arange(0, SUB_T)",
               f"row_ok{sfx} = rows{sfx} < T  # tokens past T load zeros and are never stored",
               f"rows64{sfx} = rows{sfx}.to(tl.int64)"]
        out += ["# two projection accumulators (even and odd streams): a chunk's 2n tensor-core dots form two",
                "# independent chains instead of one through a single accumulator (one accumulator per stream",
                "# took the 16 x 64 sm_90 builds to 255 registers and spills)"]
        out += [f"acc_{k}{sfx} = tl.full([SUB_T, SLOT], 0.0, dtype=tl.float32)" for k in range(2)]
        out += [f"sumsq{sfx} = tl.full([SUB_T], 0.0, dtype=tl.float32)",
                f"csq{sfx} = tl.full([SUB_T], 0.0, dtype=tl.float32)"]
        return out

    def sub_setup(sfx: str) -> list[str]:
        """One sub-tile's per-token scalars (loads: after _begin, before the chunk loop)."""
        out = ["if HAS_POST:",
               "    # per-token scalars as [SUB_T] columns: post_j = post[t, j], comb_i_j = comb[t, i, j]"]
        out += [f"    post_{j}{sfx} = tl.load(post_ptr + rows64{sfx} * stride_post + {j}, mask=row_ok{sfx}, other=0.0)"
                for j in streams]
        out += [f"    comb_{i}_{j}{sfx} = tl.load(comb_ptr + rows64{sfx} * stride_comb + {i * n + j}, "
                f"mask=row_ok{sfx}, other=0.0)" for i in streams for j in streams]
        out.append("if not FRESH:")
        out += [f"    pre_{k}{sfx} = tl.load(cpre_ptr + rows64{sfx} * stride_cpre + {k}, mask=row_ok{sfx}, other=0.0)"
                for k in streams]
        return out

    def sub_finish(sfx: str) -> list[str]:
        acc = tree_sum([f"acc_{k}{sfx}" for k in range(2)])
        return [f"_add_partials(acc_ptr, csq_slot, T, tile, acc_copy, rows64{sfx}, row_ok{sfx}, {acc}, sumsq{sfx}, "
                f"csq{sfx}, TILE_T, ACC_COPIES, ATOMIC, CSQ_SLOT)"]

    def widen_lines(sfx: str) -> list[str]:  # the rounded X' in fp32, as every later step reads it
        return [f"xf_{k}{sfx} = _widen(x_{k}{sfx}, INTERPRETED)" for k in streams]

    def collapse_expr(sfx: str) -> str:  # hc_pre with the carried (or, in _collapse, the fresh) pre
        return " + ".join(f"pre_{k}{sfx}[:, None] * xf_{k}{sfx}" for k in streams)

    def sub_body(sfx: str) -> str:
        """One sub-tile's share of a chunk, names suffixed with `sfx`."""
        sub = {"S": sfx}
        post = [f"yf{sfx} = _widen(y{sfx}, INTERPRETED)"] + [f"xf_{i}{sfx} = _widen(x_{i}{sfx}, INTERPRETED)"
                                                             for i in streams]
        post.append("# mHC post: X'[j] = post[j] * y + sum_i comb[i, j] X[i] (C^T X: the sum runs over comb's")
        post.append("# first index), in fp32, rounded to the stream dtype and stored")
        for j in streams:
            mix = " + ".join(f"comb_{i}_{j}{sfx}[:, None] * xf_{i}{sfx}" for i in streams)
            post.append(f"x_{j}{sfx} = _round(post_{j}{sfx}[:, None] * yf{sfx} + ({mix}), INTERPRETED)")
        post.append("if (LEAVE_STREAM_STORES & LEAVE_OUT) == 0:")
        for j in streams:
            post.append(f"    tl.store(xo_ptr + rows64{sfx}[:, None] * ND + ({j} * D) + d[None, :], x_{j}{sfx}, "
                        f"mask=ok{sfx}, eviction_policy=\"evict_first\")")
        sub["POST_LINES"] = "\n".join("    " + r for r in post)
        sub["F32_LINES"] = "\n".join(widen_lines(sfx))
        sub["SUMSQ_EXPR"] = " + ".join(f"xf_{k}{sfx} * xf_{k}{sfx}" for k in streams)
        sub["COLLAPSE_EXPR"] = collapse_expr(sfx)
        return SUB_BODY.substitute(sub).rstrip("\n")

    def project(k: int, sfx: str) -> str:
        operand = f"xf_{k}{sfx}" if fp16 else f"x_{k}{sfx}"  # fp16: the widened X' meets fp32 fn
        return (f"acc_{k % 2}{sfx} = _project(acc_{k % 2}{sfx}, _opaque({operand}, INTERPRETED), "
                f"{', '.join(pieces[k])}, {'PRESPLIT, ' if bf16 else ''}INTERPRETED)")

    # per stream, every sub-tile's dots with fn's block, one after the other (its pieces are split
    # once and die at once)
    block("PROJECT_LINES", 8, [line for k in streams
                               for line in (project(k, ""), "if SUB_TILES > 1:", "    " + project(k, SUB_SUFFIX[1]))])

    def both_sub_tiles(lines_for) -> list[str]:  # sub-tile 0, then sub-tile 1 where there are two
        return lines_for(0) + ["if SUB_TILES > 1:"] + ["    " + r for r in lines_for(1)]

    block("SUB_ROWS", 4, both_sub_tiles(lambda s: sub_rows(SUB_SUFFIX[s], "SUB_T + " if s else "")))
    block("SUB_SETUP", 4, both_sub_tiles(lambda s: sub_setup(SUB_SUFFIX[s])))
    block("SUB_FINISH", 4, both_sub_tiles(lambda s: sub_finish(SUB_SUFFIX[s])))
    block("SUB_BODY", 0, sub_body("").split("\n"))
    block("SUB_BODY_S1", 4, sub_body(SUB_SUFFIX[1]).split("\n"))
    block("FRESH_PRE_LINES", 4,
          [f"pre_{k} = tl.load(pre_ptr + rows64 * N + {k}, mask=row_ok, other=0.0)"
           for k in streams])
    block("FRESH_XO_LINES", 12,
          [f"x_{k} = tl.load(x_ptrs{step(k, 'D')}, mask=ok, other=0.0)" for k in streams])
    block("FRESH_X_LINES", 12,
          [f"x_{k} = tl.load(x_ptrs{step(k, 'stride_xk')}, mask=ok, other=0.0)" for k in streams])
    block("F32_LINES", 8, widen_lines(""))
    block("GATE_LINES", 8, gate_lines(spec))
    block("COMB_LINES", 8, comb_lines(spec))
    lines["TRACE_EVENTS"] = len(TRACE_EVENTS)
    lines["COUNT_MASK"] = hex((1 << HANDOFF_SHIFT) - 1)
    lines["HANDOFF_SHIFT"] = HANDOFF_SHIFT
    lines["LEAVE_CONSTANTS"] = "\n".join(f"LEAVE_{part.upper()} = tl.constexpr({bit})"
                                         for part, bit in LEAVE_OUT_PARTS.items())
    lines["TRACE_CONSTANTS"] = "\n".join(
        [f"EV_{name.upper()} = tl.constexpr({i})" for i, name in enumerate(TRACE_EVENTS)]
        + [f"ROLE_{name.upper().replace(' ', '_')} = tl.constexpr({i})" for i, name in enumerate(TRACE_ROLES)])
    lines["COLLAPSE_EXPR"] = collapse_expr("")

    math_doc = []
    if spec.has_post:
        math_doc.append("    X'    = (post[j] * y + sum_i comb[i, j] X[i]) in fp32, rounded          (stored)")
    else:
        math_doc.append("    X'    = X                                         (no post: not stored)")
    if spec.has_coefficients:
        math_doc += [
            f"    r     = rsqrt(mean(X'^2 over n*D) + {fmt_float(spec.stat_eps)})",
            "    m     = (X' . fn^T) * r = [m_pre | m_post | m_comb]",
            f"    pre'  = sigmoid(m_pre * scale0 + base_pre) + {fmt_float(spec.hc_eps)}             (stored)",
            "    post' = 2 * sigmoid(m_post * scale1 + base_post)                   (stored)",
            f"    comb' = Sinkhorn(m_comb * scale2 + base_comb), {spec.sinkhorn_iters} iterations      (stored)"]
    p = "pre'" if spec.pre == "fresh" else "the carried pre"
    math_doc += [
        f"    c     = sum_k p[k] X'[k] in fp32, rounded, with p = {p}",
        f"    u     = c * rsqrt(mean(c^2) + {fmt_float(spec.norm_eps)}) * norm_weight, rounded        (stored)"
        if spec.norm_rounding == "once" else
        f"    u     = (c * rsqrt(mean(c^2) + {fmt_float(spec.norm_eps)}), rounded) * norm_weight, rounded  (stored)"]
    spec_line = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(spec).items())
    body = CHUNK_BODY.substitute(lines)
    lines["BUFFERED_BODY"] = lines["PIPELINED_BODY"] = "\n".join(
        (" " * 12 + line) if line.strip() else line for line in body.rstrip("\n").split("\n"))
    project_functions = PROJECT_BF16 if bf16 else string.Template(PROJECT_FP32).substitute(
        PROJECT_FP16_NOTE=" With fp16 streams xs is the widened (exact) X'." if fp16 else "")
    # fp16 streams round with .to(), to nearest even in both modes (numpy's conversion in the
    # interpreter); fp32 streams round nothing
    round_other = "x.to(tl.float16)" if fp16 else "x"
    return TEMPLATE.substitute(
        KEY=key, SPEC_LINE=spec_line, FORM=spec.form(), N=n, D=spec.dim,
        DTYPE_NAME=spec.stream_dtype, MATH_DOC="\n".join(math_doc), CONSTANTS=_constants(spec),
        PROJECT_FUNCTIONS=project_functions, ROUND_OTHER=round_other, **lines)


def kernel_name(spec: MhcSpec) -> str:
    """The cache file stem: content-addressed (MhcSpec.key)."""
    return f"mega_mhc_{spec.key()}"


def source_path(spec: MhcSpec):
    """Write (if needed) and return the cached source file of `spec`."""
    return kernel_cache.write_source(kernel_name(spec), generate_source(spec))


def load(spec: MhcSpec, interpret: bool):
    """The jitted kernel of `spec` for one mode (writes the source to the cache on first use)."""
    return kernel_cache.load_generated(kernel_name(spec), lambda: generate_source(spec), KERNEL_NAME, interpret)
