"""Honest numbers: every measured figure in the docs leads to the run that produced it.

    python3 -m megafuse.tools.claims --check [FILE ...]   # the pages in CHECKED by default
    python3 -m megafuse.tools.claims --write [FILE ...]   # rewrite claim texts and tables from the results
    python3 -m megafuse.tools.claims --list               # each claim: value, device, date, command, derivation
    ... --root DIR                                        # another checkout (the tests check a copy)

**A claim in a page.** A measured number is written as a link to its result file whose title names
the claim, the link relative to the page:

    [78.4 TFLOP/s](../results/mega_gate/bench.json "claim: gate.tf32x3_rate")

A table of measured numbers is rendered whole between two marker lines, with a caption under it
that names the device, the date, the command and the result file:

    <!-- claims: gate.bench -->
    ...
    <!-- /claims -->

**The registry** below holds each claim: its name, its result file under results/, a function of
the loaded JSON giving the value, the format that renders it, and for a derived figure (a ratio,
a difference, a range) the text saying how it was derived. Each result file's provenance is read
from its JSON (`environment.device` or `device`, `date` or `environment.date`, `command`); where the
JSON lacks the command, `RESULTS` gives it and says where it was taken from.

**The check** (`--check`) holds each page to its results: every claim text equals its rendering,
its link points at its claim's result file, its section names the device that produced it (an H100
figure says H100), every rendered table equals its rendering, and no number followed by a unit of
time, speed, memory or bandwidth stands in prose without a claim (fenced code, inline code, claim
links and rendered tables aside; `EXEMPT` lists the few such numbers that are settings or names).
`--write` repairs what the results can repair: claim texts, their links and the tables.

Pure text and JSON: no torch, so the check runs anywhere in a fraction of a second.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]

# The pages whose numbers are claims. The rest of docs/ and README.md join as they are converted.
CHECKED = ("README.md", "docs/mega_gate.md", "docs/mega_mhc.md", "docs/mega_attention.md", "docs/mega_indexer.md",
           "docs/measuring.md", "docs/compiling.md", "docs/model.md", "docs/glossary.md", "docs/spellings.md",
           "docs/serving.md", "docs/tools.md")


# ------------------------------------------------------------------------------------------------
# Provenance: where each result file came from

@dataclasses.dataclass(frozen=True)
class Result:
    """A result file's command where its JSON does not record one, and where that command was read."""
    command: str
    source: str


NOT_RECORDED = "command not recorded"

RESULTS = {
    "results/mega_gate/bench.json": Result(
        "python3 -m megafuse.tools.bench_gate --sweep", "docs/mega_gate.md; the JSON holds the sweep's stages"),
    "results/mega_mhc/bench.json": Result(
        "python3 -m megafuse.tools.bench_mhc --trace, then --skip-correctness --tokens 512,4096",
        "the JSON's `runs`: two calls on one H200 the same day"),
    "results/mega_mhc/sweep.json": Result(
        "python3 -m megafuse.tools.bench_mhc --sweep --trace", "docs/mega_mhc.md; the JSON holds the trace stages"),
    "results/mega_mhc/leave_out.json": Result(
        "python3 -m megafuse.tools.bench_mhc --leave-out --skip-correctness",
        "the JSON's stages: the leave-out runs only, no correctness stage"),
    "results/mega_attention/bench.json": Result(
        "python3 -m megafuse.tools.bench_attention --out attention.json",
        "the run's job; this JSON predates the benchmark's command field"),
    "results/mega_attention/sweep.json": Result(
        "python3 -m megafuse.tools.bench_attention --configs 16x32x4x2,32x32x4x2,32x32x8x2,64x32x8x2,64x16x8x2,"
        "16x64x4x2,16x32x4x3", "docs/mega_attention.md (the JSON's configs_T stages)"),
    "results/compiled/bench.json": Result("python3 -m megafuse.tools.bench_compiled", "docs/measuring.md"),
    "results/decode/flash-lite-8e.json": Result(
        "python3 -m megafuse.tools.bench_decode --config results/decode/flash-lite-8e.config.json --batches 32 "
        "--context 32768 --repeat 10", "docs/mega_attention.md"),
    "results/decode/flash-lite-8e-no-mega-attention.json": Result(
        "python3 -m megafuse.tools.bench_decode --config results/decode/flash-lite-8e.config.json --batches 32 "
        "--context 32768 --repeat 10 --profiled 3 --no-mega-attention",
        "docs/mega_attention.md (the same run with --no-mega-attention); --profiled 3 from the JSON's profile"),
    "results/decode/bench.json": Result(
        "python3 -m megafuse.tools.bench_decode --batches 1,32 --context 32768", "docs/serving.md"),
    "results/step/bench.json": Result("python3 -m megafuse.tools.bench_step", "docs/serving.md"),
    "results/serve/bench.json": Result(
        "megafuse bench-serve --config flash-lite --device cuda --configs bounded-replay,exact-replay --sessions 8 "
        "--turns 12 --context-cap 6000 --tool-result 500 2000 --output-cap 64 --slots 32 --token-budget 1024 "
        "--buckets 2,8,32,128,512,1024 --prefill-probe 32768 --no-mega-attention --json bench.json --png bench.png",
        "results/serve/bench.log's header"),
    "results/tools/run_proxy.json": Result(
        "megafuse run --config proxy --device cuda --prompt-len 64 --decode 16", "README.md"),
    "results/tools/ablate_proxy.json": Result(
        "megafuse ablate --config proxy --device cuda --prompt-len 64", "docs/measuring.md"),
    "results/tools/inspect_proxy.json": Result("megafuse inspect --config proxy --device cuda", "docs/measuring.md"),
    "results/tools/inspect_layer1_T4096.json": Result(NOT_RECORDED, "neither its log nor the docs give it"),
}


@dataclasses.dataclass(frozen=True)
class Provenance:
    device: str   # as the JSON names it, less the vendor: "H200", "H100 80GB HBM3"
    date: str     # YYYY-MM-DD
    command: str
    source: str   # where the command was read: "the JSON" or the registry's note


def provenance(data: dict, path: str) -> Provenance:
    env = data.get("environment") or {}
    device = str(env.get("device") or data.get("device") or "device not recorded").removeprefix("NVIDIA ")
    date = str(data.get("date") or env.get("date") or "date not recorded")[:10]
    if data.get("command"):
        return Provenance(device, date, data["command"], "the JSON")
    result = RESULTS.get(path, Result(NOT_RECORDED, "not in RESULTS"))
    return Provenance(device, date, result.command, result.source)


def model(device: str) -> str:
    """The name a page must say for a figure from this device: "H100" for "H100 80GB HBM3"."""
    return device.split()[0] if device else device


# ------------------------------------------------------------------------------------------------
# The registry

Value = Callable[..., object]  # (the claim's JSON, then each of its `also` JSONs) -> a number or a tuple


@dataclasses.dataclass(frozen=True)
class Claim:
    name: str
    result: str                 # the file its link points at, under results/
    value: Value
    format: str | Callable[[object], str]  # str.format of the value (a tuple fills several fields), or a function
    derived: str = ""           # how a derived figure was computed from the measured ones
    also: tuple[str, ...] = ()  # further result files the value reads

    def render(self, datas: list[dict]) -> str:
        value = self.value(*datas)
        if callable(self.format):
            return self.format(value)
        return self.format.format(*value) if isinstance(value, tuple) else self.format.format(value)


@dataclasses.dataclass(frozen=True)
class Table:
    name: str
    result: str
    header: tuple[str, ...]
    rows: Callable[..., list[list[str]]]  # (the JSON, then each `also` JSON) -> formatted cells
    derived: str = ""
    also: tuple[str, ...] = ()


def us(v: float) -> str:
    """Microseconds to three significant figures, whole from 100 up: 4.67, 38.0, 234, 1771."""
    return f"{v:#.3g}".rstrip(".") if abs(v) < 99.95 else f"{v:.0f}"


def signed_us(v: float) -> str:
    return f"{v:+.2f} us"


def bandwidth(gbps: float) -> str:
    return f"{gbps:.0f} GB/s" if gbps < 1000 else f"{gbps / 1000:.2f} TB/s"


def sci(v: float) -> str:
    """Two significant figures, a short exponent: 2.8e-3."""
    mantissa, exponent = f"{v:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def by_T(rows: list[dict], T: int) -> dict:
    [row] = [r for r in rows if r["T"] == T]
    return row


def gate_sweep_us(d: dict, T: int, variant: str = "split") -> float:
    """The gate sweep's median for the shipped configuration (the one the benchmark ran at T), or for
    the tiled variant."""
    shipped = by_T(d["results"], T)["config"]
    [us_] = [r["graph_us"] for r in d["sweep"][str(T)]
             if r["variant"] == variant and (variant == "tiled" or r["config"] == shipped)]
    return us_


def mhc_sweep_us(d: dict, T: int, **changes) -> float:
    """The Mega-mHC sweep's median for its first row at T (the tuned configuration of that build)
    with `changes` to its launch options: each option against the same launch without it."""
    rows = d["sweep"][str(T)]
    wanted = {**rows[0]["config"], **changes}
    [us_] = [r["graph_us"] for r in rows if r["config"] == wanted]
    return us_


DECODE = "results/decode/flash-lite-8e.json"
DECODE_WITHOUT = "results/decode/flash-lite-8e-no-mega-attention.json"


def step(d: dict) -> dict:
    return d["passes-32"]


def kernel_us(d: dict) -> float:
    """Device kernel time per step: the profile's time summed over every launcher."""
    return sum(step(d)["profile"]["time_us"].values())


def attention_us(d: dict, without: dict | None = None) -> float:
    """Attention's kernel time per step: MegaAttention's, measured; without the pass, derived as
    MegaAttention's time plus the difference of the two steps' kernel time."""
    mega = step(d)["profile"]["time_us"]["mega_attention"]
    return mega if without is None else mega + kernel_us(without) - kernel_us(d)


def attention_layers(d: dict) -> int:
    return step(d)["counts"]["mega_attention"]


def gate_row(r: dict) -> list[str]:
    return [str(r["T"]), f"{us(r['fused_graph_us'])} us", f"{us(r['compile_graph_us'])} us",
            f"{us(r['eager_graph_us'])} us", f"{us(r['floor_us'])} us", f"{r['speedup_vs_compile']:.1f}x"]


def mhc_row(r: dict) -> list[str]:
    return gate_row(r) + [bandwidth(r["achieved_gbps"])]


def compiled_rows(d: dict) -> list[list[str]]:
    rows = []
    for chain, prefix in (("seam", "mhc"), ("gate", "gate")):
        for key in sorted((k for k in d if k.startswith(prefix + "_T")), key=lambda k: d[k]["T"]):
            r = d[key]
            rows.append([chain, str(r["T"])] + [f"{us(r[f])} us" for f in ("fused_graph_us", "compile_graph_us",
                                                                               "eager_graph_us", "floor_us")]
                        + [f"{r['speedup_vs_compile_graph']:.1f}x"]
                        + [f"{us(r[f])} us" for f in ("fused_eager_call_us", "compile_eager_call_us",
                                                      "op_launch_overhead_us")])
    return rows


LEAVE_OUT = ("dots", "fn_loads", "stream_stores", "parked_store")


def leave_out_rows(d: dict) -> list[list[str]]:
    rows = []
    for T, run in sorted(d["leave_out"].items(), key=lambda kv: int(kv[0])):
        by_part = {r["left_out"]: r for r in run["rows"]}
        rows.append([T, f"{us(by_part[None]['graph_us'])} us"]
                    + [signed_us(by_part[part]["graph_saved_us"]) for part in LEAVE_OUT])
    return rows


def decode_launcher_rows(d: dict) -> list[list[str]]:
    s = step(d)
    time, share, counts = s["profile"]["time_us"], s["profile"]["share"], s["counts"]
    labels = {
        "mega_attention": f"MegaAttention ({counts['mega_attention']} layers, T = {d['batches'][0]} rows each)",
        "mega_mhc": f"mega_mhc ({counts['mega_mhc']} seams)",
        "mega_gate": f"mega_gate ({counts['mega_gate']})",
        "inductor": "Inductor's kernels (the gathers and byte decodes before attention among them)",
        "other": "cuBLAS, grouped GEMMs, ATen and the rest",
    }
    return [[label, f"{time[k]:.0f}", f"{share[k]:.1%}"] for k, label in labels.items()]


def decode_with_without_rows(d: dict, without: dict) -> list[list[str]]:
    def both(f):
        return [f(d), f(without)]
    rows = [("device kernel time per step (us)", *both(lambda x: f"{kernel_us(x):.0f}")),
            ("Inductor's kernels (us)", *both(lambda x: f"{step(x)['profile']['time_us']['inductor']:.0f}")),
            ("cuBLAS, ATen and the rest (us)", *both(lambda x: f"{step(x)['profile']['time_us']['other']:.0f}")),
            ("attention (us per step)", f"{attention_us(d):.0f} (MegaAttention, measured)",
             f"{attention_us(d, without):.0f} (derived)"),
            ("attention's share of the kernel time", f"{attention_us(d) / kernel_us(d):.1%}",
             f"{attention_us(d, without) / kernel_us(without):.1%}"),
            ("step with CUDA graphs (ms)", *both(lambda x: f"{step(x)['graphs_step_s'] * 1e3:.1f}")),
            ("step without CUDA graphs (ms)", *both(lambda x: f"{step(x)['no_graphs_step_s'] * 1e3:.1f}"))]
    return [list(r) for r in rows]


COMPILE, COMPILE_8L = "results/compile/flash-lite-8e.json", "results/compile/flash-lite-8e-8l.json"
SITES = ("mega_mhc", "mega_gate", "mega_attention")


def compile_runs(d: dict, phase: str) -> list[dict]:
    """bench_compile's runs of one phase, in the order they ran (a second `blocks` run is the warm start)."""
    return [r for r in d["runs"] if r["phase"] == phase]


def graphs_cell(r: dict) -> str:
    graphs, cached = r["graphs"], r["graphs_from_cache"]
    if not cached:
        return str(graphs)
    return f"{graphs}, all {cached} from the cache" if cached == graphs else f"{graphs}, {cached} from the cache"


def sites_cell(r: dict) -> str:
    return ", ".join(str(r["counts"][p]) for p in SITES)


def gib(r: dict) -> str:
    return f"{r['graph_bytes'] / 2 ** 30:.2f} GiB"


def compile_cold_warm_rows(d: dict) -> list[list[str]]:
    cold, warm = compile_runs(d, "blocks")
    B = [str(b) for b in d["batches"]]
    runs = (cold, warm)
    return [["first step, compiles included", *(f"{r['compile_s']:.1f} s" for r in runs)],
            ["graphs (one per kind of layer, and the head)", *(graphs_cell(r) for r in runs)],
            ["fused sites per step (mHC, gate, attention)", *(sites_cell(r) for r in runs)],
            ["step with CUDA graphs, " + " / ".join(f"B = {b}" for b in B),
             *(" / ".join(f"{r['graphs_step_s'][b] * 1e3:.1f}" for b in B) + " ms" for r in runs)],
            [f"graph pool, {cold['captures']} decode buckets (2..{d['token_budget']} rows)", *(gib(r) for r in runs)]]


def compile_blocks_regions_rows(d: dict) -> list[list[str]]:
    [blocks], [regions] = compile_runs(d, "blocks"), compile_runs(d, "regions")
    runs = (blocks, regions)
    return [["cold compile", *(f"{r['compile_s']:.1f} s ({r['graphs']} graphs)" for r in runs)],
            ["fused sites per step", *(sites_cell(r) for r in runs)],
            *([f"step with CUDA graphs, B = {b}", *(f"{r['graphs_step_s'][str(b)] * 1e3:.2f} ms" for r in runs)]
              for b in d["batches"]),
            [f"graph pool, {blocks['captures']} decode buckets", *(gib(r) for r in runs)]]


def per_graph_s(r: dict) -> float:
    return r["compile_s"] / r["graphs"]


# Serving on an H200 (docs/serving.md): the batched step, the decode step, the agentic workload
STEP, DECODE_B, SERVE = "results/step/bench.json", "results/decode/bench.json", "results/serve/bench.json"


def step_counts(d: dict) -> str:
    c = d["compiled"]["counts"]
    return (f"{c['encoder']['mega_mhc']} + {c['decoder']['mega_mhc']} seams, "
            f"{c['encoder']['mega_gate']} + {c['decoder']['mega_gate']} gates")


def step_rows(d: dict) -> list[list[str]]:
    eager, compiled = d["eager"], d["compiled"]
    return [["eager `model.step`", f"{us(eager['step_s'])} s", f"{eager['peak_allocated_bytes'] / 1e9:.1f} GB", "-"],
            [f"compiled regions, all passes ({step_counts(d)})", f"{us(compiled['step_s'])} s",
             f"{compiled['peak_allocated_bytes'] / 1e9:.1f} GB", f"{compiled['compile_s']:.0f} s"]]


def decode_graphs_rows(d: dict) -> list[list[str]]:
    rows = []
    for b in d["batches"]:
        r = d[f"passes-{b}"]
        rows.append([str(b), f"{r['no_graphs_step_s'] * 1e3:.1f} ms", f"{r['graphs_step_s'] * 1e3:.1f} ms",
                     f"{r['no_graphs_step_s'] / r['graphs_step_s']:.2f}x", f"{r['capture_s']:.2f} s",
                     f"{r['graph_bytes'] / 1e9:.2f} GB"])
    return rows


def serve_label(engine: dict) -> str:
    if not engine["prefix_cache"]:
        return "no prefix cache"
    replay = "bounded replay" if engine["swa_bounded_replay"] else "exact replay"
    return f"{replay} + trim" if engine["trim_decoder"] else f"{replay}, no trim"


def serve_rows(d: dict) -> list[list[str]]:
    rows = []
    for c in d["configurations"].values():
        t = c["ttft_s"]
        rows.append([serve_label(c["engine"]), *(f"{t[q]:.2f} s" for q in ("p50", "p90", "p99")),
                     f"{c['tpot_s']['p50'] * 1e3:.0f} ms", f"{c['tokens_per_s_per_gpu']:.1f}",
                     f"{c['stats']['replayed_tokens']:,}", f"{c['stats']['trimmed_tokens']:,}",
                     f"{c['makespan_s']:.0f} s"])
    return rows


def serve_same(d: dict, f: Callable[[dict], object]) -> object:
    """A figure every configuration of the run shares (the requests served, the prefix hits)."""
    values = {repr(f(c)) for c in d["configurations"].values()}
    if len(values) != 1:
        raise ValueError(f"the configurations differ: {sorted(values)}")
    return f(next(iter(d["configurations"].values())))


def decode_counts(d: dict) -> tuple[int, int]:
    """The fused sites of the decode step, which every batch size's run must share (one compile serves them)."""
    counts = {(d[f"passes-{b}"]["counts"]["mega_mhc"], d[f"passes-{b}"]["counts"]["mega_gate"]) for b in d["batches"]}
    if len(counts) != 1:
        raise ValueError(f"the batch sizes' counts differ: {sorted(counts)}")
    return counts.pop()


def serve_config(d: dict, name: str) -> dict:
    return d["configurations"][name]


GATE, MHC, SWEEP = "results/mega_gate/bench.json", "results/mega_mhc/bench.json", "results/mega_mhc/sweep.json"
ATTENTION, COMPILED = "results/mega_attention/bench.json", "results/compiled/bench.json"
ATTENTION_SWEEP = "results/mega_attention/sweep.json"
INDEXER = "results/mega_indexer/bench.json"


def attention_sweep_rows(d: dict) -> list[list[str]]:
    """One row per launch tile of the sweep, its CUDA-graph median at each T (a failed build: its error)."""
    tokens = sorted(int(k.removeprefix("configs_T")) for k in d if k.startswith("configs_T"))
    rows = {}
    for T in tokens:
        for r in d[f"configs_T{T}"]:
            tile = f"{r['block_h']} x {r['block_j']}, {r['num_warps']} warps, {r['num_stages']} stages"
            rows.setdefault(tile, []).append(us(r["graph_us"]) if r.get("graph_us") else "failed")
    return [[tile, *cells] for tile, cells in rows.items()]


TARGET = "the benchmark's target, recorded in its JSON: a setting, not a measurement"

TABLES = {t.name: t for t in (
    Table("gate.bench", GATE, ("T", "fused", "same chain, torch.compile", "eager", "floor", "vs compile"),
          lambda d: [gate_row(r) for r in d["results"]], derived="vs compile = torch.compile / fused"),
    Table("mhc.bench", MHC,
          ("T", "fused", "same chain, torch.compile", "eager", "floor", "vs compile", "achieved"),
          lambda d: [mhc_row(r) for r in d["results"]],
          derived="vs compile = torch.compile / fused; achieved = the floor's bytes / fused"),
    Table("mhc.leave_out", "results/mega_mhc/leave_out.json",
          ("T", "launch", "saved without the dots", "without fn's loads", "without the stream stores",
           "without the parked store"),
          leave_out_rows, derived="saved = the launch's median less the median with that part compiled out"),
    Table("attention.bench", ATTENTION,
          ("T", "fused us", "torch.compile us", "eager us", "floor us", "x compile", "x floor"),
          lambda d: [[str(r["T"])] + [us(r[f]) for f in ("fused_graph_us", "compile_graph_us", "eager_graph_us",
                                                         "floor_us")]
                     + [f"{r['speedup_vs_compile']:.2f}", f"{r['x_of_practical_floor']:.1f}"] for r in d["results"]],
          derived="x compile = torch.compile / fused; x floor = fused / max(floor, the launch floor)"),
    Table("attention.sweep", ATTENTION_SWEEP, ("heads x keys a tile", "T = 1", "16", "64", "128", "512", "4096"),
          attention_sweep_rows, derived="each tile at choose_config's key split, CUDA-graph medians in us"),
    Table("indexer.bench", INDEXER,
          ("batch x context", "fused us", "torch.compile us", "eager us", "floor us", "x compile", "x floor"),
          lambda d: [[f"{d['batch']} x {d['context'] // 1024}K"]
                     + [us(d["summary"][f]) for f in ("fused_us", "compile_us", "eager_us", "floor_us")]
                     + [f"{d['summary']['speedup_vs_compile']:.2f}", f"{d['summary']['x_floor']:.1f}"]],
          derived="x compile = torch.compile / fused; x floor = fused / the floor"),
    Table("compiled.bench", COMPILED,
          ("chain", "T", "fused", "torch.compile", "eager", "floor", "vs compile", "no graph: fused",
           "no graph: compile", "op host cost"),
          compiled_rows, derived="vs compile = torch.compile / fused, both in CUDA graphs; op host cost = the op's "
                                 "back-to-back call less its graph-replayed time"),
    Table("decode8e.launchers", DECODE, ("launcher", "us per step", "share"), decode_launcher_rows),
    Table("decode8e.with_without", DECODE, ("", "with the pass", "without it"), decode_with_without_rows,
          derived="attention without the pass = MegaAttention's time with it + the difference of the two steps' "
                  "kernel time", also=(DECODE_WITHOUT,)),
    Table("compile8e.cold_warm", COMPILE, ("", "cold (empty caches)", "warm (a second process)"),
          compile_cold_warm_rows, derived="graph pool = the pool's reserved bytes (`graph_bytes`) in GiB"),
    Table("compile8e8l.blocks_regions", COMPILE_8L, ("", "per kind of layer", "whole regions"),
          compile_blocks_regions_rows, derived="graph pool = the pool's reserved bytes (`graph_bytes`) in GiB"),
    Table("step.bench", STEP, ("", "step", "peak memory", "compile"), step_rows),
    Table("decode.graphs", DECODE_B, ("batch", "without graphs", "CUDA graphs", "graphs' speed-up", "capture",
                                      "graph memory"), decode_graphs_rows,
          derived="graphs' speed-up = the step without graphs / with them; graph memory = `graph_bytes` in GB"),
    Table("serve.configurations", SERVE, ("configuration", "TTFT P50", "TTFT P90", "TTFT P99", "TPOT P50",
                                          "tok/s per GPU", "replayed tokens", "trimmed tokens", "makespan"),
          serve_rows, derived="TPOT = (last - first token) / (outputs - 1); tok/s per GPU = the outputs over the "
                              "makespan; makespan on the run's clock of measured step times"),
)}

CLAIMS = {c.name: c for c in (
    # Mega-Gate (docs/mega_gate.md)
    Claim("gate.hbm_rate", GATE, lambda d: d["hbm_bytes_per_s"] / 1e12, "{:.1f} TB/s"),
    Claim("gate.tf32x3_rate", GATE, lambda d: d["rates"]["tf32x3_tflops"], "{:.1f} TFLOP/s"),
    Claim("gate.tiled_slower_T4096", GATE, lambda d: gate_sweep_us(d, 4096, "tiled") / gate_sweep_us(d, 4096) - 1,
          "{:.0%}", derived="the tiled variant's sweep median / the shipped configuration's, minus one"),
    Claim("gate.tiled_slower_T512", GATE, lambda d: gate_sweep_us(d, 512, "tiled") / gate_sweep_us(d, 512),
          "{:.1f}x", derived="the tiled variant's sweep median / the shipped configuration's"),
    *(Claim(f"gate.tf32_against_fused_T{T}", GATE,
            lambda d, T=T: (by_T(d["results"], T)["plain_tf32_optin"]["graph_us"],
                            by_T(d["results"], T)["fused_graph_us"]), "{:.3g} against {:.3g} us")
      for T in (1, 64, 4096)),
    Claim("gate.tf32_wrong_rows_T4096", GATE,
          lambda d: (by_T(d["results"], 4096)["plain_tf32_optin"]["check"]["wrong_rows"], 4096), "{} of {} rows"),

    # Mega-mHC (docs/mega_mhc.md)
    Claim("mhc.hbm_rate", MHC, lambda d: d["hbm_bytes_per_s"] / 1e12, "{:.1f} TB/s"),
    Claim("mhc.pdl_T1", MHC, lambda d: (by_T(d["results"], 1)["fused_graph_us"],
                                        by_T(d["results"], 1)["fused_no_pdl_graph_us"]), "{:.2f} against {:.2f} us"),
    Claim("mhc.pdl_T64", MHC, lambda d: (by_T(d["results"], 64)["fused_graph_us"],
                                         by_T(d["results"], 64)["fused_no_pdl_graph_us"]), "{:.2f} against {:.2f} us"),
    Claim("mhc.sweep.sub_tiles_T4096", SWEEP, lambda d: (mhc_sweep_us(d, 4096),
                                                         mhc_sweep_us(d, 4096, tile_t=16, sub_tiles=1)),
          "{:.1f} against {:.1f} us"),
    Claim("mhc.sweep.rescale_stages_T4096", SWEEP, lambda d: (mhc_sweep_us(d, 4096),
                                                              mhc_sweep_us(d, 4096, rescale_stages=0)),
          "{:.1f} against {:.1f} us"),
    Claim("mhc.sweep.acc_copies_T64", SWEEP, lambda d: (mhc_sweep_us(d, 64), mhc_sweep_us(d, 64, acc_copies=1)),
          "{:.2f} against {:.2f} us"),
    Claim("mhc.sweep.acc_copies8_T64", SWEEP, lambda d: (mhc_sweep_us(d, 64, acc_copies=8), mhc_sweep_us(d, 64)),
          "{:.2f} against {:.2f} us"),
    Claim("mhc.sweep.tiled_T4096", SWEEP,
          lambda d: (mhc_sweep_us(d, 4096, tile_t=16, split_cols=5120, r_splits=0, sub_tiles=1),
                     mhc_sweep_us(d, 4096)), "{:.1f} against {:.1f} us"),
    Claim("mhc.sweep.presplit_T4096", SWEEP, lambda d: (mhc_sweep_us(d, 4096, presplit_fn=True),
                                                        mhc_sweep_us(d, 4096)), "{:.1f} against {:.1f} us"),
    Claim("mhc.sweep.presplit_T512", SWEEP, lambda d: (mhc_sweep_us(d, 512, r_splits=10, presplit_fn=True),
                                                       mhc_sweep_us(d, 512, r_splits=10)), "{:.1f} against {:.1f} us"),

    # MegaAttention (docs/mega_attention.md)
    Claim("attention.max_rel_err", ATTENTION, lambda d: max(c["rel_err"] for c in d["correctness"]), sci,
          derived="the largest relative error of the benchmark's correctness checks"),
    Claim("attention.launch_floor", ATTENTION, lambda d: d["launch_floor_us"], "{:g} us",
          derived="the benchmark's launch floor, a setting"),
    Claim("attention.target_compile_T1", ATTENTION, lambda d: by_T(d["results"], 1)["target_vs_compile"], "{:g}x",
          derived=TARGET),
    Claim("attention.target_compile_T64", ATTENTION, lambda d: by_T(d["results"], 64)["target_vs_compile"],
          "{:g}x", derived=TARGET),
    Claim("attention.target_floor", ATTENTION, lambda d: by_T(d["results"], 512)["target_x_floor"], "{:g}x",
          derived=TARGET),
    Claim("attention.vs_compile_from_T64", ATTENTION,
          lambda d: (min(r["speedup_vs_compile"] for r in d["results"] if r["T"] >= 64),
                     max(r["speedup_vs_compile"] for r in d["results"] if r["T"] >= 64)), "{:.2f}-{:.2f}x",
          derived="torch.compile / fused, least and most over T >= 64"),

    # Mega-Indexer (docs/mega_indexer.md)
    Claim("indexer.differing_rows", INDEXER, lambda d: d["correctness"]["fused"]["differing_rows"], "{}",
          derived="rows whose fused top-k set differs from the fp64 reference's"),
    Claim("indexer.target_compile", INDEXER, lambda d: d["targets"]["speedup_vs_compile"], "{:g}x", derived=TARGET),
    Claim("indexer.target_floor", INDEXER, lambda d: d["targets"]["x_floor"], "{:g}x", derived=TARGET),
    Claim("attention.x_floor_from_T128", ATTENTION,
          lambda d: (min(r["x_of_practical_floor"] for r in d["results"] if r["T"] >= 128),
                     max(r["x_of_practical_floor"] for r in d["results"] if r["T"] >= 128)), "{:.1f}-{:.1f}x",
          derived="fused / max(floor, the launch floor), least and most over T >= 128"),
    Claim("attention.vs_compile_T16_T64", ATTENTION,
          lambda d: (by_T(d["results"], 16)["speedup_vs_compile"], by_T(d["results"], 64)["speedup_vs_compile"]),
          "{:.1f}-{:.1f}x", derived="torch.compile / fused at T = 16 and at T = 64"),

    # The decode step on an H100 (docs/mega_attention.md)
    *(Claim(f"decode8e.count.{p}", DECODE, lambda d, p=p: step(d)["counts"][p], "{}")
      for p in ("mega_mhc", "mega_gate", "mega_attention")),
    Claim("decode8e.graphs_step", DECODE, lambda d: step(d)["graphs_step_s"] * 1e3, "{:.1f} ms"),
    Claim("decode8e.no_graphs_step", DECODE, lambda d: step(d)["no_graphs_step_s"] * 1e3, "{:.1f} ms"),
    Claim("decode8e.first_run", DECODE, lambda d: step(d)["first_run_s"], "{:.0f} s"),
    Claim("decode8e.kernel_time", DECODE, lambda d: kernel_us(d) / 1e3, "{:.1f} ms",
          derived="the profile's kernel time per step, summed over the launchers"),
    Claim("decode8e.attention_per_layer", DECODE, lambda d: attention_us(d) / attention_layers(d), "{:.0f} us",
          derived="MegaAttention's kernel time per step / the layers it fused at"),
    Claim("decode8e.attention_share", DECODE, lambda d: step(d)["profile"]["share"]["mega_attention"], "{:.1%}"),
    Claim("decode8e.mega_attention_us", DECODE, lambda d: attention_us(d), "{:.0f} us"),
    Claim("decode8e.without.first_run", DECODE_WITHOUT, lambda d: step(d)["first_run_s"], "{:.0f} s"),
    Claim("decode8e.without.attention_per_layer", DECODE_WITHOUT,
          lambda w, d: attention_us(d, w) / attention_layers(d), "{:.0f} us", also=(DECODE,),
          derived="(MegaAttention's time with the pass + the difference of the two steps' kernel time) / the layers"),
    Claim("decode8e.without.attention_share", DECODE_WITHOUT, lambda w, d: attention_us(d, w) / kernel_us(w),
          "{:.1%}", also=(DECODE,), derived="the derived attention time / the step's kernel time without the pass"),
    Claim("decode8e.without.kernel_time_difference", DECODE_WITHOUT, lambda w, d: kernel_us(w) - kernel_us(d),
          "{:.0f} us", also=(DECODE,), derived="kernel time per step without the pass less with it"),
    *(Claim(f"decode8e.without.{launcher}_difference", DECODE_WITHOUT,
            lambda w, d, k=launcher: step(w)["profile"]["time_us"][k] - step(d)["profile"]["time_us"][k],
            "{:.0f} us", also=(DECODE,), derived=f"the profile's '{launcher}' time without the pass less with it")
      for launcher in ("inductor", "other")),
    Claim("decode8e.without.attention_speedup", DECODE_WITHOUT, lambda w, d: attention_us(d, w) / attention_us(d),
          "{:.1f}x", also=(DECODE,), derived="the derived attention time without the pass / MegaAttention's"),
    Claim("decode8e.without.graphs_speedup", DECODE_WITHOUT,
          lambda w, d: step(w)["graphs_step_s"] / step(d)["graphs_step_s"], "{:.3f}x", also=(DECODE,),
          derived="the step with CUDA graphs without the pass / with it"),
    Claim("decode8e.without.no_graphs_difference", DECODE_WITHOUT,
          lambda w, d: (step(d)["no_graphs_step_s"] - step(w)["no_graphs_step_s"]) * 1e3, "{:.0f} ms",
          also=(DECODE,), derived="the step without CUDA graphs with the pass less without it"),
    Claim("decode8e.without.no_graphs_pair", DECODE_WITHOUT,
          lambda w, d: (step(d)["no_graphs_step_s"] * 1e3, step(w)["no_graphs_step_s"] * 1e3),
          "{:.1f} against {:.1f} ms", also=(DECODE,)),

    # Through the compiler (docs/measuring.md)
    *(Claim(f"compiled.{chain}_vs_compile", COMPILED,
            lambda d, p=prefix: (min(v["speedup_vs_compile_graph"] for k, v in d.items() if k.startswith(p)),
                                 max(v["speedup_vs_compile_graph"] for k, v in d.items() if k.startswith(p))),
            "{:.1f}-{:.1f}x", derived="torch.compile / fused in CUDA graphs, least and most over T")
      for chain, prefix in (("seam", "mhc_T"), ("gate", "gate_T"))),
    Claim("compiled.op_host_small_T", COMPILED,
          lambda d: (min(v["op_launch_overhead_us"] for k, v in d.items() if k.endswith(("_T1", "_T64"))),
                     max(v["op_launch_overhead_us"] for k, v in d.items() if k.endswith(("_T1", "_T64")))),
          "{:.0f}-{:.0f} us", derived="the op's host cost, least and most over both chains at T = 1 and 64"),
    # Compiling once: blocks, warm starts, the graph pool, on an H100 (docs/compiling.md)
    Claim("compile8e.cold", COMPILE, lambda d: compile_runs(d, "blocks")[0]["compile_s"], "{:.1f} s"),
    Claim("compile8e.warm", COMPILE, lambda d: compile_runs(d, "blocks")[1]["compile_s"], "{:.1f} s"),
    Claim("compile8e.cold_per_graph", COMPILE, lambda d: per_graph_s(compile_runs(d, "blocks")[0]), "{:.0f} s",
          derived="the cold first step's seconds, compiles included / the graphs it compiled"),
    Claim("compile8e.warm_per_graph", COMPILE, lambda d: per_graph_s(compile_runs(d, "blocks")[1]), "{:.0f} s",
          derived="the warm first step's seconds (Dynamo's traces, the cache lookups, the step) / its graphs"),
    Claim("compile8e8l.cold_per_graph", COMPILE_8L, lambda d: per_graph_s(compile_runs(d, "blocks")[0]), "{:.0f} s",
          derived="the cold first step's seconds, compiles included / the graphs it compiled"),
    Claim("compile8e8l.blocks_vs_regions_logits", COMPILE_8L,
          lambda d: tuple(d["summary"]["blocks_vs_regions_logits_max_abs"][str(b)] for b in (1, 32)),
          "{:.3f} (B = 1) and {:.3f} (B = 32)"),
    Claim("compile8e8l.run_to_run_logits", COMPILE_8L,
          lambda d: (d["summary"]["run_to_run_max_abs"]["blocks"], d["summary"]["run_to_run_max_abs"]["regions"]),
          "{:.3f} for blocks, {:.3f} for regions"),

    # Serving on an H200 (docs/serving.md)
    Claim("step.weights", STEP, lambda d: d["build"]["weights_on_device_bytes"] / 1e9, "{:.1f} GB"),
    Claim("step.cache", STEP, lambda d: sum(d["compare"]["cache_bytes"].values()) / 1e9, "{:.2f} GB",
          derived="the byte cache's pools summed: SWA rows, global KV, index keys, compressor state"),
    Claim("step.logits_error", STEP, lambda d: d["compare"]["max_abs_logits_error"], "{:.2f}"),
    Claim("step.top1", STEP, lambda d: d["compare"]["top1_agreement"], "{:.0%}"),
    Claim("decode.counts", DECODE_B, lambda d: decode_counts(d), "{} seams and {} gates",
          derived="the fused sites of both region graphs, the same at every batch"),
    Claim("decode.first_run", DECODE_B, lambda d: d[f"passes-{d['batches'][0]}"]["first_run_s"], "{:.0f} s"),
    Claim("decode.graphs_logits", DECODE_B, lambda d: tuple(d[f"passes-{b}"]["graphs_vs_no_graphs_max_abs"]
                                                            for b in (1, 32)), "{:.2f} (batch 1) and {:.2f} (batch 32)"),
    Claim("decode.batch1_bound", DECODE_B,
          lambda d: d["passes-32"]["no_graphs_step_s"] / d["passes-1"]["graphs_step_s"], "{:.1f}x",
          derived="batch 32's step without graphs / batch 1's with them: a bound on batch 1's graphs' speed-up"),
    Claim("serve.think_time", SERVE, lambda d: d["workload"]["think_time_s"], "{:g} s",
          derived="the workload's think time, a setting recorded in the JSON"),
    Claim("serve.counts", SERVE, lambda d: (d["steps"]["passes"]["counts"]["mega_mhc"],
                                            d["steps"]["passes"]["counts"]["mega_gate"]), "{} seams and {} gates"),
    Claim("serve.requests", SERVE, lambda d: serve_same(d, lambda c: c["requests"]), "{} requests"),
    Claim("serve.hits", SERVE, lambda d: serve_same(d, lambda c: (c["stats"]["prefix_hits"], c["prefix_hit_rate"])),
          "{} prefix hits, {:.0%} of prompt tokens",
          derived="the share of prompt tokens = the tokens the hits took from the cache / every prompt's tokens"),
    Claim("serve.p90_ratio", SERVE,
          lambda d: serve_config(d, "exact-replay")["ttft_s"]["p90"] / serve_config(d, "bounded-replay")["ttft_s"]["p90"],
          "{:.1f}x", derived="exact replay without the trim's P90 TTFT / bounded replay with the trim's"),
    Claim("serve.probe_trim", SERVE, lambda d: d["prefill_probe"]["trim_ttft_s"], "{:.2f} s"),
    Claim("serve.probe_no_trim", SERVE, lambda d: d["prefill_probe"]["no_trim_ttft_s"], "{:.2f} s"),
    Claim("serve.probe_speedup", SERVE, lambda d: d["prefill_probe"]["trim_speedup"], "{:.2f}x",
          derived="the probe's time to first token without the trim / with it"),
    Claim("serve.first_run", SERVE, lambda d: d["steps"]["passes"]["graphs"]["first_run_s"], "{:.0f} s"),
    Claim("serve.graphs", SERVE, lambda d: (d["steps"]["passes"]["graphs"]["graphs"],
                                            d["steps"]["passes"]["graphs"]["captures"]),
          "{} region graphs compiled and {} buckets captured"),
    Claim("serve.capture", SERVE, lambda d: d["steps"]["passes"]["graphs"]["capture_s"], "{:.1f} s"),
    Claim("serve.graph_memory", SERVE, lambda d: d["steps"]["passes"]["graphs"]["graph_bytes"] / 1e9, "{:.1f} GB"),
)}


# Numbers with a unit that are settings or names, not measurements; each says why.
EXEMPT = {
    "H100 80GB HBM3": "the card's name as CUDA reports it",
    "A 90 s cold compile": "docs/compiling.md: the cold compile's target, which the runs fall short of, not a measurement",
    "A 15 s warm start": "docs/compiling.md: the warm start's target, which the runs fall short of, not a measurement",
    "~197 GB in bf16": "docs/model.md: the size of flash's Engram table computed from the config (384M rows of 256 "
                       "at 2 bytes), not a measurement",
}


# ------------------------------------------------------------------------------------------------
# Reading a page

CLAIM_LINK = re.compile(r'\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+) "claim: (?P<name>[^"]+)"\)')
BLOCK_OPEN = re.compile(r"^<!-- claims: (?P<name>\S+) -->\s*$")
BLOCK_CLOSE = "<!-- /claims -->"
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
COMMENT = re.compile(r"<!--.*?-->")
_NUM = r"\d+(?:\.\d+)?"
_UNIT = r"(?:x(?![\w])|\s?(?:GB/s|TB/s|TFLOP/s|tokens/s|tok/s|GiB|GB|min|ms|µs|us|s|%)(?![\w/]))"
# a number with a unit, and the numbers chained to it ("9.06 against 8.89 us", "1.9-2.2x", "18.5/40 us")
MEASURED = re.compile(rf"(?<![\w.^]){_NUM}(?:\s*(?:/|-|–|against)\s*{_NUM})*{_UNIT}")


@dataclasses.dataclass
class Block:
    name: str
    open: int   # the marker lines' indexes
    close: int


@dataclasses.dataclass
class Page:
    """A page's lines, which of them are prose, and its rendered blocks."""
    path: str                 # relative to the root
    lines: list[str]
    prose: list[bool]         # outside fenced code and rendered blocks
    blocks: list[Block]
    unclosed: list[Block]

    @classmethod
    def read(cls, root: Path, path: str) -> "Page":
        lines = (root / path).read_text().split("\n")
        prose, blocks, unclosed = [True] * len(lines), [], []
        fence, block = None, None
        for i, line in enumerate(lines):
            if block is not None:
                prose[i] = False
                if line.strip() == BLOCK_CLOSE:
                    block.close = i
                    blocks.append(block)
                    block = None
            elif fence is not None:
                prose[i] = False
                if line.strip().startswith(fence):
                    fence = None
            elif m := FENCE.match(line):
                prose[i], fence = False, m.group(1)
            elif m := BLOCK_OPEN.match(line):
                prose[i], block = False, Block(m.group("name"), i, -1)
        if block is not None:
            unclosed.append(block)
        return cls(path, lines, prose, blocks, unclosed)

    def claim_links(self):
        """(line index, match) of each claim link in prose, outside inline code."""
        for i, line in enumerate(self.lines):
            if not self.prose[i]:
                continue
            code = [m.span() for m in CODE_SPAN.finditer(line)]
            for m in CLAIM_LINK.finditer(line):
                if not any(a <= m.start() < b for a, b in code):
                    yield i, m

    def section(self, i: int) -> str:
        """The text from the heading above line i to the next heading."""
        heading = [j for j, line in enumerate(self.lines) if self.prose[j] and line.startswith("#")]
        start = max([j for j in heading if j <= i], default=0)
        end = min([j for j in heading if j > i], default=len(self.lines))
        return "\n".join(self.lines[start:end])

    def unclaimed(self):
        """(line index, text) of each measured-looking number in prose that no claim covers."""
        for i, line in enumerate(self.lines):
            if not self.prose[i]:
                continue
            masked = line
            for pattern in (CODE_SPAN, CLAIM_LINK, LINK_TARGET, COMMENT):
                masked = pattern.sub(lambda m: " " * len(m.group(0)), masked)
            for phrase in EXEMPT:
                masked = masked.replace(phrase, " " * len(phrase))
            for m in MEASURED.finditer(masked):
                yield i, m.group(0).strip()


# ------------------------------------------------------------------------------------------------
# Rendering from the results

class RenderError(Exception):
    """A claim or table the results cannot give: a missing file, a key its JSON lacks."""


class Results:
    """The result files of one root, loaded once."""

    def __init__(self, root: Path):
        self.root = root

    @functools.cache
    def load(self, path: str) -> dict:
        return json.loads((self.root / path).read_text())

    def provenance(self, path: str) -> Provenance:
        return provenance(self.load(path), path)

    @staticmethod
    def files(item: Claim | Table) -> tuple[str, ...]:
        return (item.result, *item.also)

    def _data(self, item: Claim | Table, compute: Callable):
        try:
            return compute(*[self.load(p) for p in self.files(item)])
        except Exception as e:  # say which claim and which files, whatever went wrong
            raise RenderError(f"claim {item.name}: cannot be computed from {', '.join(self.files(item))}: "
                              f"{type(e).__name__}: {e}") from e

    def claim(self, claim: Claim) -> str:
        return self._data(claim, lambda *datas: claim.render(list(datas)))

    def rows(self, table: Table) -> list[list[str]]:
        return self._data(table, table.rows)

    def table(self, table: Table, page: str) -> list[str]:
        """The lines between a table's markers: the table, then its caption."""
        lines = ["", "| " + " | ".join(table.header) + " |", "|" + "---|" * len(table.header)]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows(table)]
        runs = []
        for path in self.files(table):
            p = self.provenance(path)
            runs.append(f"{p.device}, {p.date}, `{p.command}`: [{path}]({link(path, page)})")
        caption = "; ".join(runs) + "." + (f" Derived: {table.derived}." if table.derived else "")
        return lines + ["", caption]


def link(result: str, page: str) -> str:
    """The result file's path relative to the page's folder."""
    return Path(os.path.relpath(result, os.path.dirname(page) or ".")).as_posix()


def resolve(target: str, page: str) -> str:
    """A link target, relative to its page, as a path relative to the root."""
    return Path(os.path.normpath(os.path.join(os.path.dirname(page), target))).as_posix()


# ------------------------------------------------------------------------------------------------
# Check and write

@dataclasses.dataclass(frozen=True)
class Problem:
    path: str
    line: int  # 1-based
    message: str

    def __str__(self):
        return f"{self.path}:{self.line}: {self.message}"


def check_page(page: Page, results: Results) -> list[Problem]:
    problems = []

    def problem(i, message):
        problems.append(Problem(page.path, i + 1, message))

    for i, m in page.claim_links():
        name, text, target = m.group("name"), m.group("text"), m.group("target")
        claim = CLAIMS.get(name)
        if claim is None:
            problem(i, f"unknown claim {name} (not in tools/claims.py's CLAIMS)")
            continue
        if resolve(target, page.path) != claim.result:
            problem(i, f"claim {name}: links to {target}, the claim's result is {claim.result}")
        try:
            rendered = results.claim(claim)
        except RenderError as e:
            problem(i, str(e))
            continue
        if text != rendered:
            problem(i, f"claim {name}: text says {text}, result gives {rendered}")
        section = page.section(i)
        for path in results.files(claim):
            device = model(results.provenance(path).device)
            if device not in section:
                problem(i, f"claim {name}: its result ran on {device}; its section does not say {device}")

    for block in page.blocks:
        table = TABLES.get(block.name)
        if table is None:
            problem(block.open, f"unknown claim {block.name} (not in tools/claims.py's TABLES)")
            continue
        try:
            rendered = results.table(table, page.path)
        except RenderError as e:
            problem(block.open, str(e))
            continue
        text = page.lines[block.open + 1:block.close]
        if text != rendered:  # name the first line that differs
            k = next((k for k, (a, b) in enumerate(zip(text, rendered)) if a != b), min(len(text), len(rendered)))
            said = text[k] if k < len(text) else "(nothing)"
            gives = rendered[k] if k < len(rendered) else "(nothing)"
            problem(block.open + 1 + k, f"claim {block.name}: text says {said}, result gives {gives}")
    for block in page.unclosed:
        problem(block.open, f"claims block {block.name} has no closing {BLOCK_CLOSE}")

    for i, text in page.unclaimed():
        problem(i, f"unclaimed measured number: {text} (make it a claim link or part of a rendered table, "
                   f"or exempt it in tools/claims.py's EXEMPT with a reason)")
    return problems


def write_page(page: Page, results: Results) -> str:
    """The page with every claim's text and link and every table rendered afresh; what the results
    cannot give (an unknown name, a missing file) is left as it is for the check to report."""
    lines = list(page.lines)
    for i, m in reversed(list(page.claim_links())):  # right to left: earlier spans keep their offsets
        claim = CLAIMS.get(m.group("name"))
        with contextlib.suppress(RenderError):
            if claim is not None:
                new = f'[{results.claim(claim)}]({link(claim.result, page.path)} "claim: {claim.name}")'
                lines[i] = lines[i][:m.start()] + new + lines[i][m.end():]
    for block in reversed(page.blocks):
        table = TABLES.get(block.name)
        with contextlib.suppress(RenderError):
            if table is not None:
                lines[block.open + 1:block.close] = results.table(table, page.path)
    return "\n".join(lines)


def listing(results: Results) -> list[str]:
    """Each claim and table: its value, then each result file's device, date and command."""
    out = []
    for item in (*CLAIMS.values(), *TABLES.values()):
        try:
            value = results.claim(item) if isinstance(item, Claim) else f"a table of {len(results.rows(item))} rows"
        except RenderError as e:
            value = str(e)
        out.append(f"{item.name} = {value}")
        for path in results.files(item):
            p = results.provenance(path)
            out.append(f"    {p.device}, {p.date}, {path}: {p.command}  (command from {p.source})")
        if item.derived:
            out.append(f"    derived: {item.derived}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m megafuse.tools.claims", description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="hold the pages' claims to their results (exit 1 on a "
                                                           "mismatch, an unknown claim or an unclaimed number)")
    mode.add_argument("--write", action="store_true", help="rewrite the pages' claim texts, links and tables")
    mode.add_argument("--list", action="store_true", help="each claim: value, device, date, command, derivation")
    ap.add_argument("files", nargs="*", help=f"pages relative to the root (default: {' '.join(CHECKED)})")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository to check (default: this one)")
    args = ap.parse_args(argv)
    results = Results(args.root)

    if args.list:
        print("\n".join(listing(results)))
        return 0
    files = args.files or list(CHECKED)
    missing = [f for f in files if not (args.root / f).is_file()]
    if missing:
        ap.error(f"no such page under {args.root}: {', '.join(missing)}")
    if args.write:
        for f in files:
            page = Page.read(args.root, f)
            text = write_page(page, results)
            if text != "\n".join(page.lines):
                (args.root / f).write_text(text)
                print(f"rewrote {f}")
    problems = [p for f in files for p in check_page(Page.read(args.root, f), results)]
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} problem(s) in {len({p.path for p in problems})} page(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
