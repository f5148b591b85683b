"""The base of every fusion pass: it owns timing, the report, the debug hook and the uuid source.

A pass declares what it anchors on, how a candidate is matched (or why it is rejected) and how a
match is rewritten into the pass's canonical op. Matching is written as plain functions that walk
the post-grad ATen graph and raise `NoMatch(reason)` at the first thing that does not fit, so every
decision has a sentence a user can read (`CompileReport.why(node)`).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable

import torch.fx as fx
from torch._inductor.pattern_matcher import stable_topological_sort

from .report import Match, PassReport, Rejection, source_location


class NoMatch(Exception):
    """A candidate does not fit; `candidate=False` means the anchor was never a candidate at all
    (reported only to the debug hook, not as a rejection)."""

    def __init__(self, reason: str, candidate: bool = True):
        super().__init__(reason)
        self.reason, self.candidate = reason, candidate


@dataclass
class Candidate:
    """A matched chain: the nodes it covers, the outputs to replace, and the spec it binds: the
    lowering's own frozen dataclass (GateSpec, MhcSpec), from the match to the launch; the op's
    arguments are made from it in one place per op (passes/ops.py)."""

    anchor: fx.Node
    nodes: list[fx.Node]
    spec: Any
    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    insert_before: fx.Node | None = None  # where the fused op goes (default: the anchor)
    left_unfused: list[str] = field(default_factory=list)  # parts of the chain that stay unfused, and why

    def described(self) -> dict:
        """The spec as the report keeps it (JSON): its fields, and `left_unfused` where there are any."""
        return dataclasses.asdict(self.spec) | ({"left_unfused": self.left_unfused} if self.left_unfused else {})


class FusionPass:
    name: ClassVar[str]
    description: ClassVar[str]
    op: ClassVar[str]
    default_options: ClassVar[dict] = {}
    option_choices: ClassVar[dict] = {}  # option -> its valid values, where they are a closed set
    run_order: ClassVar[int] = 100  # the manager runs passes by ascending run_order

    def __init__(self, **options):
        unknown = set(options) - set(self.default_options)
        if unknown:
            raise ValueError(f"pass {self.name!r}: unknown options {sorted(unknown)}; valid: {sorted(self.default_options)}")
        for option, value in options.items():
            choices = self.option_choices.get(option)
            if choices is not None and value not in choices:
                raise ValueError(f"pass {self.name!r}: {option}={value!r} is not a valid value; valid: "
                                 f"{', '.join(map(repr, choices))}")
        self.options = {**self.default_options, **options}

    # ---- what a pass declares -------------------------------------------------------------------

    def anchors(self, graph: fx.Graph) -> Iterable[fx.Node]:
        raise NotImplementedError

    def match(self, anchor: fx.Node) -> Candidate:
        """Return the candidate or raise NoMatch(reason)."""
        raise NotImplementedError

    def check(self, candidate: Candidate) -> str | None:
        """None when the kernel supports the candidate's spec; else why it stays unfused."""
        return None

    def rewrite(self, graph: fx.Graph, candidate: Candidate) -> fx.Node:
        raise NotImplementedError

    # ---- what the base does ---------------------------------------------------------------------

    def source(self) -> str:
        """The pass's code for the cache key: its module (matcher, checks, rewrite)."""
        return inspect.getsource(inspect.getmodule(type(self)))

    def run(self, graph: fx.Graph) -> PassReport:
        report = PassReport(self.name)
        start = time.perf_counter()
        for anchor in list(self.anchors(graph)):
            if anchor.graph is not graph or not anchor.users:  # erased or left dead by an earlier rewrite
                continue
            try:
                candidate = self.match(anchor)
            except NoMatch as e:
                report.decisions[anchor.name] = f"no match: {e.reason}"
                if e.candidate:
                    report.rejections.append(Rejection(anchor.name, e.reason, source_location(anchor)))
                continue
            reason = self.check(candidate)
            if reason is not None:
                report.decisions[anchor.name] = f"unsupported: {reason}"
                report.rejections.append(Rejection(anchor.name, reason, source_location(anchor)))
                continue
            replaced = [n.name for n in candidate.nodes]
            sources = list(dict.fromkeys(s for s in map(source_location, candidate.nodes) if s))
            new = self.rewrite(graph, candidate)
            report.decisions[anchor.name] = f"matched -> {new.name}"
            report.matches.append(Match(self.op, new.name, candidate.described(), replaced, sources))
        if report.matches:
            stable_topological_sort(graph)  # a fused op may sit after a reader Inductor hoisted
        graph.eliminate_dead_code()
        graph.lint()
        report.time_s = time.perf_counter() - start
        return report
