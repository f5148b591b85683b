"""Benchmark of the Mega-Indexer chain where users get it: through `megafuse.passes.compile`.

    python3 -m megafuse.tools.bench_indexer [--batch 32] [--context 32768] [--config flash-lite] [--ratio R]
                                            [--select-configs 1024x4,4096x8] [--out PATH]
    python3 -m megafuse.tools.bench_indexer --dry-run     # CPU, the Triton interpreter

The chain is the indexer part of the runtime's decode step (`model.attention.Attention.step`, a full
layer without a candidate mask), written with the model's own functions (`IndexerStep`): each of
`batch` rows (one decode row per request) reads its request's pages of index-key bytes from the
cache's pool, decodes them (`model.cache.row_codec`: MXFP4 under quant "ref"), scores them
(`index_scores`), masks the entries it cannot see (`visible_entries`) and takes the top-k
(`select_topk`). At the preset's widths (index_heads x index_head_dim, index_topk, its dtype for the
queries and the decoded keys): each request holds `context` tokens, `context // ratio` entries, on
pages of `DEFAULT_PAGE_SIZE` tokens (`DEFAULT_PAGE_SIZE // ratio` entries a page) scattered over the
pool by a random permutation; every row sits at position context - 1 (all its entries visible); the
keys are random values encoded by the codec, q random values rounded as the model rounds them
(MXFP4 under "ref"), w random fp32. The ratio defaults to that of the config's plain full layers
(index sources that neither publish nor use candidate blocks).

Stages (each one saves the JSON; a failing stage is logged and the rest run):

1. `inputs`: the pool, page tables, q, w, positions on the device.
2. `fused`: `passes.compile(module, passes=["mega_indexer"], dynamic=False)`, its first call; the
   report must count exactly {"mega_indexer": 1} (else the rejections' reasons are recorded and the
   stage fails). `compile`: `passes.compile(module, passes="none", dynamic=False)` (plain Inductor).
3. `correctness`: the top-k of fused, compile and eager against `fp64_topk` (written here: the keys
   decoded to fp32, the scores in fp64, ties to the lowest entry, -1 padded), compared as sets per
   row; a differing row is a tie aside when every entry it differs by scores within TIE_RTOL of the
   row's K-th fp64 score.
4. `time_fused`, `time_compile`, `time_eager`: CUDA-graph replay medians (`time_graph_us`); eager
   falls back to ordinary launches (`time_eager_us`) if its graph capture fails, and says so.
5. `summary`: floor = (index-key bytes read once + q + w + the top-k written) / the device's peak HBM
   bandwidth (`bench_common.peak_hbm_bytes_per_s`); x_floor = fused / floor and the speed-ups against
   the targets (x_floor <= 1.5, speedup_vs_compile >= 3).

`--select-configs BLOCKxWARPS,...`: after the timings, the selection launch alone
(`mega_indexer.select`) on the row scores the op computes (the fused match's spec), at each sweep
step (BLOCK scores a step) and warp count, checked equal to `select_topk` on the same scores (a
launch that chooses otherwise fails the run) and timed in a CUDA graph (the data behind
`choose_config`'s selection launch); a launch that fails to build or run is a row with its error.

`--dry-run`: CPU, the Triton interpreter, toy sizes (batch 3, 64 tokens on pages of 8 entries, the
tiny preset's 4 heads x 32 and top-6 at the config's quant and dtype), stages 1-3 only (and the
selection configs' checks, untimed); its JSON goes to a temp file unless --out names one. Schema
"megafuse.bench_indexer/1" (docs/tools.md).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import torch
from torch import nn

from megafuse import passes
from megafuse.lowering.mega_indexer import IndexerSpec, LaunchConfig, mega_indexer, select
from megafuse.model import ConfigError, preset, resolve_config
from megafuse.model.attention import NEG_INF, index_scores, select_topk, visible_entries
from megafuse.model.cache import DEFAULT_PAGE_SIZE, RowCodec, row_codec
from megafuse.model.quant import fake_quant_index_mxfp4
from megafuse.tools.bench_common import Stages, command_line, default_out, open_log, hbm_rate_or_reason, require_cuda, \
    time_eager_us, time_graph_us
from megafuse.tools.common import in_range, launch_shapes, power_of_two

SCHEMA = "megafuse.bench_indexer/1"
PASS = "mega_indexer"
WAYS = ("fused", "compile", "eager")
TARGETS = {"x_floor": 1.5, "speedup_vs_compile": 3.0}  # x_floor at most, speedup_vs_compile at least
# An entry chosen in place of another is a tie aside when both score within this of the K-th score
# (relative, fp64): the fused kernel and Inductor sum the heads in other orders than fp64 does.
TIE_RTOL = 1e-6
DIFFERING_ROWS_KEPT = 8  # differing rows listed in the JSON (all are counted)
# The interpreter's toy sizes: a few pages of 8 entries (16 tokens at ratio 2); the tiny preset's
# indexer widths (4 heads x 32, top-6) at the config's quant and dtype.
DRY_RUN = dict(batch=3, context=64, page_size=16, widths="tiny")


class IndexerStep(nn.Module):
    """The indexer part of `Attention.step` for one row a request (no candidate mask): the request's
    pages of key bytes decoded, scored, masked by visibility, the top-k [1, R, K].

    q [R, H, d] (the keys decode to its dtype, as the step decodes them to the stream's), w [R, H]
    fp32, pool uint8 [pages, entries a page, row bytes], pages [R, pages a request], positions [R]."""

    def __init__(self, codec: RowCodec, dtype: torch.dtype, ratio: int, topk: int):
        super().__init__()
        self.codec, self.dtype, self.ratio, self.topk = codec, dtype, ratio, topk

    def keys(self, pool, pages):
        return self.codec.decode(pool[pages].flatten(1, 2), self.dtype)

    def scores(self, q, w, keys, positions):
        visible = visible_entries(positions, keys.shape[-2], self.ratio)
        return index_scores(q[None], w[None], keys[None], visible[None])

    def select(self, scores):
        return select_topk(scores, self.topk)

    def forward(self, q, w, pool, pages, positions):
        return self.select(self.scores(q, w, self.keys(pool, pages), positions))


def plain_ratio(cfg) -> int:
    """The compress ratio of the config's plain full layers: index sources that own their keys and
    neither publish candidate blocks nor score inside them (the chain this benchmark times)."""
    ratios = sorted({cfg.compress_ratios[layer] for layer in cfg.index_source_layers
                     if cfg.role(layer) == "full" and layer != cfg.candidate_source_layer
                     and not cfg.uses_candidates(layer)})
    if not ratios:
        raise ConfigError(f"config {cfg.name!r} has no full layer outside the candidate source: pass --ratio")
    return ratios[0]


def make_inputs(cfg, batch: int, context: int, ratio: int, page_size: int, device, seed: int = 0) -> tuple:
    """(q, w, pool, pages, positions): `batch` requests of `context` tokens, each on its own pages of
    the pool, in a random order (a permutation of the pool's pages); every row at position context - 1."""
    g = torch.Generator().manual_seed(seed)
    codec = row_codec(cfg, "index_keys")
    per_page, pages_per_request = page_size // ratio, -(-context // page_size)
    pool_pages = batch * pages_per_request
    pool = torch.empty(pool_pages, per_page, codec.row_bytes, dtype=torch.uint8, device=device)
    for start in range(0, pool_pages, 1024):  # encoded a slice at a time: the fp32 values are 4x the bytes
        n = min(1024, pool_pages - start)
        pool[start:start + n] = codec.encode(torch.randn(n, per_page, cfg.index_head_dim, generator=g).to(device))
    pages = torch.randperm(pool_pages, generator=g).view(batch, pages_per_request)
    q = torch.randn(batch, cfg.index_heads, cfg.index_head_dim, generator=g)
    q = fake_quant_index_mxfp4(q) if cfg.quant == "ref" else q  # as Indexer.scores rounds its queries
    w = torch.randn(batch, cfg.index_heads, generator=g)
    positions = torch.full((batch,), context - 1, dtype=torch.int64)
    return (q.to(device, getattr(torch, cfg.dtype)), w.to(device), pool, pages.to(device), positions.to(device))


# ---- the reference ----------------------------------------------------------------------------------

def fp64_scores(q, w, pool, pages, positions, codec: RowCodec, ratio: int) -> torch.Tensor:
    """[R, N] fp64: sum_h w relu(q . k) over the keys decoded to fp32 (exact: the codec's values),
    -inf where entry n >= (position + 1) // ratio. One row at a time (N x d fp64 keys each)."""
    rows = []
    for r in range(q.shape[0]):
        keys = codec.decode(pool[pages[r]].flatten(0, 1), torch.float32).double()  # [N, d]
        logits = (q[r].double() @ keys.t()).clamp(min=0)  # [H, N]
        scores = w[r].double() @ logits
        visible = torch.arange(keys.shape[0], device=keys.device) < (int(positions[r]) + 1) // ratio
        rows.append(scores.masked_fill(~visible, NEG_INF))
    return torch.stack(rows)


def fp64_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[R, k] int64: the k largest of `scores` above -inf, ties to the lowest entry, ascending, -1 padded."""
    padded = torch.cat((scores, scores.new_full((scores.shape[0], k), NEG_INF)), dim=1)
    values, ids = torch.sort(padded, dim=1, descending=True, stable=True)  # stable: equal scores by entry
    beyond = padded.shape[1]  # sorts after every entry, then becomes -1
    ids = torch.where(values[:, :k] > NEG_INF, ids[:, :k], beyond).sort(dim=1).values
    return torch.where(ids == beyond, -1, ids)


def compare_sets(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor, rtol: float = TIE_RTOL) -> dict:
    """Per row, the set of `got`'s entries against `want`'s (each [R, K], -1 for none). A differing
    row is a tie aside when every entry in one set and not the other scores (fp64) within `rtol` of
    the row's K-th score, the smallest of `want`'s: that entry and its neighbour are equal in fp32."""
    got, want, scores = got.cpu(), want.cpu(), scores.cpu()
    differing = []
    for r in range(want.shape[0]):
        mine, theirs = set(got[r].tolist()), set(want[r].tolist())
        if mine == theirs and got[r].tolist().count(-1) == want[r].tolist().count(-1):
            continue
        chosen = [n for n in theirs if n >= 0]
        kth = min(scores[r, n].item() for n in chosen) if chosen else NEG_INF
        entries = sorted(n for n in mine ^ theirs if n >= 0)
        gaps = [abs(scores[r, n].item() - kth) / max(abs(kth), 1e-300) if 0 <= n < scores.shape[1] else float("inf")
                for n in entries]
        gap = max(gaps, default=float("inf"))  # a row differing by -1s alone is no tie
        differing.append({"row": r, "only_got": sorted(mine - theirs), "only_reference": sorted(theirs - mine),
                          "max_rel_gap": gap, "tie": gap <= rtol})
    return {"rows": int(want.shape[0]), "differing_rows": len(differing),
            "differing_not_ties": sum(not d["tie"] for d in differing),
            "ties_aside": all(d["tie"] for d in differing), "differing": differing[:DIFFERING_ROWS_KEPT]}


# ---- the floor ---------------------------------------------------------------------------------------

def floor_bytes(batch: int, entries: int, row_bytes: int, heads: int, head_dim: int, q_itemsize: int,
                topk: int) -> dict:
    """The bytes one call must move: each row's visible index-key rows read once (codec bytes, the
    scales included), q and w (fp32) read, the top-k (int64) written. The page table and positions
    (8 bytes a page and a row) are left out: under 0.5% at the defaults."""
    parts = {"index_keys": batch * entries * row_bytes, "q": batch * heads * head_dim * q_itemsize,
             "w": batch * heads * 4, "topk": batch * topk * 8}
    return parts | {"total": sum(parts.values())}


def floor(res: dict, device_name: str | None) -> dict:
    nbytes = floor_bytes(res["batch"], res["entries"], res["row_bytes"], res["heads"], res["head_dim"],
                         getattr(torch, res["dtype"]).itemsize, res["topk"])
    rate, note = hbm_rate_or_reason(device_name, "dry run on the CPU: no device bandwidth")
    return {"bytes": nbytes, "hbm_peak_bytes_per_s": rate,
            "floor_us": nbytes["total"] / rate * 1e6 if rate else None, "note": note}


# ---- the stages ---------------------------------------------------------------------------------------

def build(state: dict, way: str, log) -> dict:
    """Compile one way (`passes.compile` with the pass, or with none) and call it once."""
    names = [PASS] if way == "fused" else "none"
    compiled = passes.compile(state["module"], passes=names, dynamic=False)
    t0 = time.time()
    with torch.no_grad():
        state[f"{way}_out"] = compiled(*state["inputs"])
    state[way] = compiled
    report = compiled.report
    r = {"compile_s": round(time.time() - t0, 1), "counts": report.counts(),
         "specs": [m.spec for m in report.matches(PASS)],
         "rejections": [{"anchor": x.anchor, "reason": x.reason} for x in report.rejections(PASS)]}
    log(f"  {way}: counts {r['counts']}, compiled in {r['compile_s']} s"
        + "".join(f"\n    rejected at {x['anchor']}: {x['reason']}" for x in r["rejections"]))
    if way == "fused" and r["counts"] != {PASS: 1}:
        state["results"]["fused"] = r  # kept although the stage fails: the reasons are the finding
        raise RuntimeError(f"the chain did not fuse once: counts {r['counts']}; rejections "
                           f"{[x['reason'] for x in r['rejections']]}")
    return r


def correctness(state: dict, log) -> dict:
    q, w, pool, pages, positions = state["inputs"]
    module = state["module"]
    scores = fp64_scores(q, w, pool, pages, positions, module.codec, module.ratio)
    want = fp64_topk(scores, module.topk)
    with torch.no_grad():
        state["eager_out"] = module(*state["inputs"])
    out = {}
    for way in WAYS:
        got = state.get(f"{way}_out")
        if got is None:
            out[way] = None  # its build failed
            continue
        out[way] = compare_sets(got[0], want, scores)
        log(f"  {way}: {out[way]['differing_rows']} of {out[way]['rows']} rows differ from fp64's top-k "
            f"({out[way]['differing_not_ties']} beyond ties)")
    return out


def timing(state: dict, way: str, log) -> dict:
    fn, args = state[way], state["inputs"]
    call = lambda: fn(*args)  # noqa: E731
    with torch.no_grad():
        try:
            r = {"us": time_graph_us(call), "timer": "cuda_graph"}
        except Exception as e:  # noqa: BLE001 - eager's capture may fail; the compiled ways must not
            if way != "eager":
                raise
            torch.cuda.synchronize()
            r = {"us": time_eager_us(call), "timer": "eager_launches",
                 "graph_error": f"{type(e).__name__}: {e}"[:500]}
    log(f"  {way}: {r['us']:.2f} us ({r['timer']})")
    return r


def summary(res: dict) -> dict:
    us = {way: (res.get(f"time_{way}") or {}).get("us") for way in WAYS}
    floor_us = res["floor"]["floor_us"]
    s = {f"{way}_us": us[way] for way in WAYS} | {"floor_us": floor_us}
    s["x_floor"] = us["fused"] / floor_us if us["fused"] and floor_us else None
    s["speedup_vs_compile"] = us["compile"] / us["fused"] if us["fused"] and us["compile"] else None
    s["speedup_vs_eager"] = us["eager"] / us["fused"] if us["fused"] and us["eager"] else None
    s["meets"] = {"x_floor": None if s["x_floor"] is None else s["x_floor"] <= TARGETS["x_floor"],
                  "speedup_vs_compile": None if s["speedup_vs_compile"] is None
                  else s["speedup_vs_compile"] >= TARGETS["speedup_vs_compile"]}
    return s


def _table(res: dict) -> list[str]:
    s = res.get("summary") or {}

    def cell(v, fmt):
        return "-" if v is None else format(v, fmt)
    lines = [f"{res['device']}  torch {res['torch']}  triton {res['triton']}",
             f"{res['config']}: batch {res['batch']}, context {res['context']} ({res['entries']} entries a row, "
             f"ratio {res['ratio']}), {res['heads']} heads x {res['head_dim']}, top-{res['topk']}, {res['key_format']}"]
    if s:  # timed (not a dry run)
        lines += [f"{'fused':>9} {'compile':>9} {'eager':>9} {'floor':>8} {'xFloor':>7} {'xCompile':>8} {'xEager':>7}"
                  f"   us; targets xFloor <= {TARGETS['x_floor']}, xCompile >= {TARGETS['speedup_vs_compile']}",
                  f"{cell(s['fused_us'], '9.2f')} {cell(s['compile_us'], '9.2f')} {cell(s['eager_us'], '9.2f')} "
                  f"{cell(s['floor_us'], '8.2f')} {cell(s['x_floor'], '7.2f')} "
                  f"{cell(s['speedup_vs_compile'], '8.2f')} {cell(s['speedup_vs_eager'], '7.2f')}"]
    for way, c in (res.get("correctness") or {}).items():
        if c is not None:
            lines.append(f"{way}: {c['differing_rows']} of {c['rows']} rows differ from fp64 "
                         f"({c['differing_not_ties']} beyond ties)")
    return lines


SELECT_FORM = ("comma-separated BLOCKxWARPS, e.g. 1024x4,4096x8 (BLOCK, the scores a sweep step, a power of two "
               ">= 256; WARPS a power of two <= 32)")


def select_configs(text: str) -> tuple[tuple[int, int], ...]:
    """An argparse type: `--select-configs`' (block, warps) pairs; another form is a usage error naming the form."""
    return launch_shapes(text, 2, lambda block, warps: block >= 256 and power_of_two(block) and power_of_two(warps)
                         and warps <= 32, SELECT_FORM)


def sweep_select(state: dict, pairs: tuple[tuple[int, int], ...], timed: bool, log) -> list[dict]:
    """The selection launch alone on the op's scores (the fused spec's) at each (block, warps): equal to
    select_topk on them, then timed; a launch that fails is a row with its error."""
    spec = IndexerSpec(**state["results"]["fused"]["specs"][0])
    scores = mega_indexer(*state["inputs"], None, spec)[1]  # the masked scores the op selects from
    want = select_topk(scores[None], spec.topk)[0]
    rows = []
    for block, warps in pairs:
        config = LaunchConfig(block_n=64, block_select=block, block_rows=1, num_warps=warps)
        row = {"block_select": block, "num_warps": warps}
        try:
            row["equal"] = bool(torch.equal(select(scores, spec, config), want))
            if timed:
                row["graph_us"] = time_graph_us(lambda: select(scores, spec, config))
        except Exception as e:  # a launch the device cannot hold is data, not the end of the sweep
            row["error"] = f"{type(e).__name__}: {e}"[:1000]
        rows.append(row)
        took = f"{row['graph_us']:.2f} us, " if "graph_us" in row else ""
        log(f"  select {block}x{warps}: " + (row["error"] if "error" in row else
                                              f"{took}{'equal' if row['equal'] else 'DIFFERS'}"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m megafuse.tools.bench_indexer", description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=in_range(at_least=1), default=32,
                    help="rows, one request each (default 32; the dry run: 3)")
    ap.add_argument("--context", type=in_range(at_least=1), default=32768,
                    help="tokens each request holds (default 32768; the dry run: 64)")
    ap.add_argument("--config", default="flash-lite", help="preset or config JSON (default flash-lite)")
    ap.add_argument("--ratio", type=in_range(at_least=1),
                    help="tokens an entry compresses (default: the config's plain full layers')")
    ap.add_argument("--select-configs", type=select_configs, metavar="BLOCKxWARPS,...",
                    help="also time the selection launch alone at each sweep step and warp count")
    ap.add_argument("--out", help="the results JSON (default results/mega_indexer/bench.json; --dry-run: a temp file)")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, toy sizes, no timings")
    args = ap.parse_args(argv)
    require_cuda(ap, args.dry_run)
    try:
        cfg = resolve_config(args.config)
        ratio = args.ratio or plain_ratio(cfg)
    except ConfigError as e:
        ap.error(str(e))
    batch, context, page_size = args.batch, args.context, DEFAULT_PAGE_SIZE
    if args.dry_run:
        batch, context, page_size = DRY_RUN["batch"], DRY_RUN["context"], DRY_RUN["page_size"]
        cfg = preset(DRY_RUN["widths"]).replace(quant=cfg.quant, dtype=cfg.dtype)
    if page_size % ratio:
        ap.error(f"--ratio {ratio} must divide the page size ({page_size} tokens)")
    if context // ratio < cfg.index_topk:
        ap.error(f"--context {context} holds {context // ratio} entries at ratio {ratio}, fewer than the "
                 f"top-{cfg.index_topk}")
    out_path = args.out or default_out("mega_indexer", args.dry_run)
    log = open_log(out_path)

    import triton
    device = torch.device("cpu" if args.dry_run else "cuda")
    codec = row_codec(cfg, "index_keys")
    res = {"schema": SCHEMA, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
           "command": command_line(ap, argv), "dry_run": args.dry_run,
           "config": cfg.name, "quant": cfg.quant, "dtype": cfg.dtype, "key_format": codec.name,
           "batch": batch, "context": context, "ratio": ratio, "page_size": page_size,
           "per_page": page_size // ratio, "pages_per_request": -(-context // page_size),
           "entries": context // ratio, "heads": cfg.index_heads, "head_dim": cfg.index_head_dim,
           "topk": cfg.index_topk, "row_bytes": codec.row_bytes, "tie_rtol": TIE_RTOL, "targets": TARGETS,
           "stages": {}}
    stages = Stages(res, out_path, log)
    state = {"results": res,
             "module": IndexerStep(codec, getattr(torch, cfg.dtype), ratio, cfg.index_topk).eval()}

    def inputs():
        state["inputs"] = make_inputs(cfg, batch, context, ratio, page_size, device)
        return {"pool_pages": state["inputs"][2].shape[0], "pool_bytes": state["inputs"][2].numel()}

    torch._dynamo.reset()  # start clear of earlier compiles (Dynamo's per-function recompile limit)
    stages.run("inputs", inputs)
    if "inputs" in state:
        for way in ("fused", "compile"):
            stages.run(way, lambda way=way: build(state, way, log))
        stages.run("correctness", lambda: correctness(state, log))
        if not args.dry_run:
            state["eager"] = state["module"]
            for way in WAYS:  # a way whose build failed (or did not fuse) is not timed
                if way == "eager" or res["stages"][way]["ok"]:
                    stages.run(f"time_{way}", lambda way=way: timing(state, way, log))
        if args.select_configs and res["stages"]["fused"]["ok"]:
            stages.run("select_configs", lambda: sweep_select(state, args.select_configs, not args.dry_run, log))
    res["floor"] = floor(res, None if args.dry_run else res["device"])
    if not args.dry_run:
        stages.run("summary", lambda: summary(res))
    stages.save()
    for line in _table(res):
        log(line)
    failed = [name for name, stage in res["stages"].items() if not stage["ok"]]
    wrong = [way for way, c in (res.get("correctness") or {}).items() if c is not None and not c["ties_aside"]]
    wrong += [f"select {r['block_select']}x{r['num_warps']}" for r in res.get("select_configs") or []
              if r.get("equal") is False]
    if failed or wrong:
        log(f"FAILED: stages {failed}; top-k sets beyond ties in {wrong} (see {out_path})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
