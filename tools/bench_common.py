"""Shared by the H200 benchmarks (tools/bench_*.py): timing (medians, CUDA-graph replay) and the
stage runner that keeps the results JSON current after every stage."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch

# H200 HBM3e bandwidth, the roofline's denominator (docs/measuring.md, "Method")
HBM_BYTES_PER_S = 4.3e12
# dense bf16 MMA, the H200's sustained rate: a FLOP-bound chain's floor (docs/measuring.md, "Method")
BF16_FLOPS = 660e12

# Peak HBM bandwidth by device name, the vendor's figure: a whole step's floor (bench_decode) against
# the most its memory can deliver. A key matches as part of torch.cuda.get_device_name() (the H100
# SXM reports "NVIDIA H100 80GB HBM3"); the first match counts. A device not listed has no floor.
HBM_PEAK_BYTES_PER_S = {"H100 80GB HBM3": 3.35e12, "H100 SXM": 3.35e12, "H200": 4.8e12}


def peak_hbm_bytes_per_s(device_name: str) -> float:
    """The peak HBM bandwidth of `device_name` (HBM_PEAK_BYTES_PER_S); ValueError naming the known
    devices for one not listed (a floor against a guessed bandwidth would mislead)."""
    for name, rate in HBM_PEAK_BYTES_PER_S.items():
        if name in device_name:
            return rate
    raise ValueError(f"no peak HBM bandwidth is known for device {device_name!r} (known: "
                     f"{', '.join(HBM_PEAK_BYTES_PER_S)}), so no floor; add its figure to "
                     "megafuse.tools.bench_common.HBM_PEAK_BYTES_PER_S")


def hbm_rate_or_reason(device_name: str | None, dry_run_note: str) -> tuple[float | None, str | None]:
    """(the peak HBM bandwidth, None), or (None, why there is none): `dry_run_note` for the CPU's dry
    run (`device_name` None), peak_hbm_bytes_per_s's error for a device not listed."""
    if device_name is None:
        return None, dry_run_note
    try:
        return peak_hbm_bytes_per_s(device_name), None
    except ValueError as e:
        return None, str(e)


def require_cuda(parser, dry_run: bool) -> None:
    """A usage error (exit 2) when a GPU run is asked for where there is no CUDA device."""
    if not dry_run and not torch.cuda.is_available():
        parser.error("this benchmark times CUDA launches and this machine has no CUDA device; "
                     "--dry-run runs its correctness part on CPU through the Triton interpreter")


def command_line(parser, argv: list[str] | None) -> str:
    """The command as run (the parser's prog and its arguments), for the result's JSON."""
    return " ".join([parser.prog, *(sys.argv[1:] if argv is None else argv)])


def default_out(folder: str, dry_run: bool) -> str:
    """Where a benchmark writes its JSON (and log) when --out is not given: results/<folder>/bench.json
    for a GPU run; a dry run (CPU, toy sizes, no timings) writes <temp dir>/<folder>_bench_dry_run.json,
    so it never replaces the committed H200 results."""
    if dry_run:
        return os.path.join(tempfile.gettempdir(), f"{folder}_bench_dry_run.json")
    return os.path.join("results", folder, "bench.json")


def open_log(out_path: str):
    """A log function for a benchmark whose JSON goes to `out_path`: each message printed and written
    to the .log beside it (flushed, so a run cut off keeps what it said)."""
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    log_file = open(os.path.splitext(out_path)[0] + ".log", "w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()
    return log


def time_graph_us(fn, rep: int = 60) -> float:
    """Median of CUDA-graph replays (launch overhead removed), in microseconds."""
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3


def time_eager_us(fn) -> float:
    """Median with ordinary launches (what an eager caller pays), in microseconds."""
    from triton.testing import do_bench
    return do_bench(fn, rep=60, return_mode="median") * 1e3


def time_cold_l2_us(fn, n: int = 40, flush_mb: int = 96, reps: int = 15) -> float:
    """Per call, with L2 flushed before each call: a graph of n x (flush; fn) minus a graph of
    n x (flush), each replayed `reps` times, medians."""
    flush = torch.empty(flush_mb * 2 ** 20 // 4, dtype=torch.float32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs = []
    with torch.cuda.stream(stream):
        fn()
        for with_fn in (True, False):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(n):
                    flush.zero_()
                    if with_fn:
                        fn()
            graphs.append(g)
    torch.cuda.synchronize()
    med = []
    for g in graphs:
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        times.sort()
        med.append(times[len(times) // 2])
    return (med[0] - med[1]) / n * 1e3


class Stages:
    """Runs benchmark stages in order; a failing stage is logged with its traceback and the run
    goes on. The results JSON is rewritten after every stage, so a run cut off by its time limit
    still leaves everything measured so far, and `resume` continues it."""

    # what must agree between a run and the one it continues, besides the caller's keys
    SAME_ENVIRONMENT = ("device", "torch", "triton", "python")

    def __init__(self, results: dict, out_path: str, log):
        self.results, self.out_path, self.log = results, out_path, log
        results.setdefault("stages", {})
        self.kept: set[str] = set()

    def resume(self, same: tuple[str, ...], rerun: tuple[str, ...] = ()) -> None:
        """Take over the stages that finished in the JSON already at out_path, so `run` skips them:
        for a benchmark longer than one sitting. `same` names the results' keys that must agree with
        that run's (the preset, the sizes, the passes), and the environment's device and versions
        must; `rerun` names stages that always run (those that build state the others use, and
        summaries). A missing or different earlier run raises ValueError naming what differs."""
        try:
            with open(self.out_path) as f:
                previous = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"nothing to resume: {self.out_path} does not exist (run without resuming first)") from None
        current = json.loads(json.dumps(self.results, default=str))  # tuples as JSON lists, as saved
        env, previous_env = current.get("environment", {}), previous.get("environment", {})
        differ = [f"{k}: {previous.get(k)!r} there, {current.get(k)!r} here" for k in same
                  if previous.get(k) != current.get(k)]
        differ += [f"environment.{k}: {previous_env.get(k)!r} there, {env.get(k)!r} here"
                   for k in self.SAME_ENVIRONMENT if previous_env.get(k) != env.get(k)]
        if differ:
            raise ValueError(f"{self.out_path} is another run's, so it cannot be resumed: " + "; ".join(differ))
        for name, stage in previous.get("stages", {}).items():
            if stage.get("ok") and name not in rerun and name in previous:
                self.results[name] = previous[name]
                self.results["stages"][name] = stage | {"kept_from": previous_env.get("date")}
                self.kept.add(name)
        self.results["resumed"] = {"from": previous_env.get("date"), "kept": sorted(self.kept)}

    def save(self) -> None:
        with open(self.out_path, "w") as f:
            json.dump(self.results, f, indent=1, default=str)

    def run(self, name: str, fn) -> None:
        if name in self.kept:
            self.log(f"== {name}: kept from the run of {self.results['stages'][name]['kept_from']}")
            return
        t0 = time.time()
        self.log(f"== {name}")
        try:
            self.results[name] = fn()
            self.results["stages"][name] = {"ok": True, "seconds": round(time.time() - t0, 1)}
        except Exception:
            tb = traceback.format_exc()
            self.log(tb)
            self.results["stages"][name] = {"ok": False, "seconds": round(time.time() - t0, 1), "error": tb[-2000:]}
        self.save()


def synthetic_decode_batch(cfg, layout, batch: int, context: int, device):
    """A decode step of `batch` requests, each holding `context` tokens it never prefilled: its
    pages hold zero bytes (cache rows decode to 0.0, every index score ties and the top-k picks the
    first entries), so the step reads and computes what a real context of that length costs. One
    request per slot, on its own pages; padded to max(batch, 2) rows (buckets hold at least 2)."""
    from megafuse.model import Sequence, build_step, page_table

    g = torch.Generator().manual_seed(batch)
    sequences = []
    for slot in range(batch):
        seq = Sequence(slot, torch.randint(0, cfg.vocab_size, (context + 1,), generator=g).tolist(), cfg.window,
                       pages=list(range(slot * layout.max_pages, (slot + 1) * layout.max_pages)))
        seq.done, seq.prefilled = context, True
        sequences.append(seq)
    rows = max(batch, 2)
    return build_step(cfg, layout, [s.chunk(1, True, True) for s in sequences], page_table(layout, sequences),
                      rows, rows, device)


def step_wall_time(step, batch, repeat: int, warmup: int = 3) -> float:
    """Median wall time of `step(batch, step.cache)` to a synchronised result (the host's launch
    cost counts: that is what CUDA graphs remove), after `warmup` untimed calls (the first calls
    after a compile or capture run slower)."""
    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    times = []
    with torch.no_grad():
        for _ in range(warmup):
            step(batch, step.cache)
        for _ in range(repeat):
            sync()
            start = time.perf_counter()
            step(batch, step.cache)
            sync()
            times.append(time.perf_counter() - start)
    return statistics.median(times)
