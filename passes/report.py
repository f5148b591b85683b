"""What every pass reports: matches, rejected candidates with the reason, time spent.

One `PassReport` per pass per compiled graph; a `CompileReport` gathers them across the graphs a
`passes.compile` produced (one per Dynamo graph, and one more per recompile) and renders the table
the tools print. Tests assert exact counts from it ("one gate per MoE layer").
"""

from __future__ import annotations

import io
import re
from collections import Counter
from dataclasses import asdict, dataclass, field

from rich.table import Table

# an FX node name in a reason: a lower-case op name with Inductor's counter (mm_6, sum_1024, getitem_3)
_NODE_NAME = re.compile(r"\b[a-z][a-z_]*_\d+\b")

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def source_location(node) -> str | None:
    """file:line of the innermost frame of the user code that produced an FX node."""
    trace = node.meta.get("stack_trace") if hasattr(node, "meta") else None
    if not trace:
        return None
    frames = _FRAME.findall(trace)
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else None


@dataclass
class Match:
    op: str  # the canonical op the chain became, e.g. "megafuse::mega_gate"
    node: str  # the new node
    spec: dict  # the spec the kernel is generated for (Candidate.described)
    replaced: list[str]  # FX node names of the chain
    sources: list[str]  # file:line of the replaced nodes, deduplicated, in graph order


@dataclass
class Rejection:
    anchor: str  # the node the pattern was anchored at
    reason: str
    source: str | None = None


@dataclass
class PassReport:
    name: str
    matches: list[Match] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    time_s: float = 0.0
    # Every anchor the matcher looked at and what it decided, for the debug hook (why not here?).
    decisions: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("decisions")
        return d


@dataclass
class GraphReport:
    passes: list[PassReport] = field(default_factory=list)
    cached: bool = False  # served from Inductor's caches: the passes ran when it was first compiled
    # Where repeated blocks share compiled graphs (passes/blocks.py): the blocks (layers) whose
    # latest call ran this graph. None for the graph of a whole module, which runs once a call.
    blocks: list[str] | None = None
    compile_id: str | None = None  # Dynamo's id of the compile in this process

    @property
    def runs(self) -> int:
        """How many times a call of the compiled module runs this graph."""
        return 1 if self.blocks is None else len(self.blocks)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "GraphReport":
        passes = [PassReport(p["name"], [Match(**m) for m in p["matches"]], [Rejection(**r) for r in p["rejections"]],
                             p["time_s"], p["decisions"]) for p in data["passes"]]
        return cls(passes, cached=data["cached"])


class CompileReport:
    """All graphs compiled under one pass manager; `counts()` sums matches per pass."""

    def __init__(self, pass_names: list[str]):
        self.pass_names = list(pass_names)
        self.graphs: list[GraphReport] = []
        self.unreported = 0  # graphs served from Inductor's caches without a stored report

    def _all(self, name: str) -> list[PassReport]:
        return [p for g in self.graphs for p in g.passes if p.name == name]

    def matches(self, name: str) -> list[Match]:
        return [m for p in self._all(name) for m in p.matches]

    def rejections(self, name: str) -> list[Rejection]:
        return [r for p in self._all(name) for r in p.rejections]

    def counts(self) -> dict[str, int]:
        """Fused sites per pass in one call of the compiled module: a graph that several blocks run
        counts once per block."""
        return {name: sum(len(p.matches) * g.runs for g in self.graphs for p in g.passes if p.name == name)
                for name in self.pass_names}

    @classmethod
    def combined(cls, *reports: "CompileReport") -> "CompileReport":
        """One report over the graphs of several compiles with the same passes (a model's regions)."""
        names = reports[0].pass_names
        if any(r.pass_names != names for r in reports):
            raise ValueError(f"reports of different pass lists cannot combine: {[r.pass_names for r in reports]}")
        out = cls(names)
        for r in reports:
            out.graphs += r.graphs
            out.unreported += r.unreported
        return out

    def why(self, node_name: str) -> dict[str, str]:
        """The debug hook: what each pass decided at the FX node `node_name` (all graphs)."""
        return {p.name: p.decisions[node_name] for g in self.graphs for p in g.passes if node_name in p.decisions}

    def to_dict(self) -> dict:
        return {
            "passes": self.pass_names,
            "graphs": len(self.graphs),
            "graphs_from_cache": sum(g.cached for g in self.graphs),
            "graph_blocks": [g.blocks for g in self.graphs],
            "graphs_unreported": self.unreported,
            "counts": self.counts(),
            "per_pass": {
                name: {
                    "matches": [asdict(m) for m in self.matches(name)],
                    "rejections": [asdict(r) for r in self.rejections(name)],
                    "time_s": sum(p.time_s for p in self._all(name)),
                }
                for name in self.pass_names
            },
        }

    def rejection_reasons(self, pass_name: str) -> list[tuple[str, int]]:
        """The pass's rejections grouped by reason, most frequent first: FX node names in a reason
        (`mm_6`, `sum_1024`) read as `<node>`, so the sites rejected for one cause make one row.
        Each rejection, with its node, stays in `rejections` (and in the JSON)."""
        counts = Counter(_NODE_NAME.sub("<node>", r.reason) for r in self.rejections(pass_name))
        return sorted(counts.items(), key=lambda item: (-item[1], item[0]))

    def __rich__(self) -> Table:  # rich's print and console.print render the table
        return self.table()

    def __str__(self) -> str:
        """The table as plain text, as `print(fused.report)` shows it."""
        from rich.console import Console
        console = Console(width=120, record=True, file=io.StringIO(), color_system=None)
        console.print(self.table())
        return console.export_text().rstrip("\n")

    def table(self) -> Table:
        cached = sum(g.cached for g in self.graphs)
        notes = [f"{cached} of {len(self.graphs)} graphs from Inductor's cache, with their reports"] if cached else []
        if self.unreported:
            notes.append(f"{self.unreported} graphs from Inductor's cache had no stored report: their matches are "
                         "missing here (compile with options={'fx_graph_cache': False} to run the passes again)")
        shared = [g for g in self.graphs if g.blocks is not None and len(g.blocks) > 1]
        if shared:
            notes.append(f"{sum(len(g.blocks) for g in shared)} blocks ran {len(shared)} shared graphs; "
                         "matches count each block")
        counts = self.counts()
        table = Table(title="megafuse passes", caption="; ".join(notes) or None)
        for col in ("pass", "matches", "rejected", "time (ms)", "rejection reasons"):
            table.add_column(col)
        for name in self.pass_names:
            reasons = [f"{reason} (x{count})" if count > 1 else reason for reason, count in self.rejection_reasons(name)]
            table.add_row(name, str(counts[name]), str(len(self.rejections(name))),
                          f"{sum(p.time_s for p in self._all(name)) * 1e3:.1f}", "\n".join(reasons) or "-")
        return table
