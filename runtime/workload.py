"""A seeded agentic workload (docs/serving.md, "The engine"): long shared prefixes that grow
turn by turn, short outputs.

    session i:  arrives at a_i (a Poisson process of `arrival_rate` sessions per second)
      turn 0:   system prompt + a first context of c tokens (log-uniform in `context`)
      turn k:   everything before + the previous output + a tool result (uniform in `tool_result`),
                sent `think_time_s` after the previous output ended
      outputs:  lognormal lengths with the given median and P95, at least 1 token

Every session starts with the same system prompt (an agent's tool definitions), so sessions share
a prefix as well as growing their own. Token ids are drawn uniformly from the vocabulary; the model
is random, so only lengths and sharing matter.

A scale (`SCALES`, `AgenticWorkload.at_scale`) sizes the workload for a machine: it multiplies every
token length (system prompt, first contexts, tool results, output median and P95) by one factor and
sets the sessions and turns. Scaling keeps each distribution's shape (a log-uniform range stays
log-uniform over [low, high] x factor), where clipping would pile its tail onto the cap.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Turn:
    new_tokens: list[int]  # appended to the session's context (after the previous output)
    max_new_tokens: int


@dataclass(frozen=True)
class Session:
    arrival_s: float
    turns: list[Turn] = field(default_factory=list)


@dataclass(frozen=True)
class Scale:
    """A size of the workload: every token length x `lengths`, and `sessions` x `turns`."""
    lengths: float
    sessions: int
    turns: int


SCALES = {
    "full": Scale(lengths=1.0, sessions=8, turns=3),  # the workload docs/serving.md describes
    # the eager tiny model on 2 CPU cores: contexts 50-1310, tool results 5-40, outputs median 2,
    # P95 20; enough turns for prefix hits within a session and sessions for hits across them
    "small": Scale(lengths=0.01, sessions=4, turns=2),
}

# z of the 95th percentile of a standard normal: P95 = median * exp(1.645 sigma) for a lognormal.
_Z95 = 1.6448536269514722


@dataclass(frozen=True)
class AgenticWorkload:
    vocab_size: int
    sessions: int = 8
    turns: int = 3
    system_prompt: int = 2_000
    context: tuple[int, int] = (5_000, 131_000)
    tool_result: tuple[int, int] = (500, 4_000)
    output_median: int = 150
    output_p95: int = 2_000
    arrival_rate: float = 0.5  # sessions per second
    think_time_s: float = 1.0
    seed: int = 0

    def __post_init__(self):
        checks = {
            "vocab_size": self.vocab_size >= 1, "sessions": self.sessions >= 1, "turns": self.turns >= 1,
            "system_prompt": self.system_prompt >= 0, "arrival_rate": self.arrival_rate > 0,
            "think_time_s": self.think_time_s >= 0,
            "context": 1 <= self.context[0] <= self.context[1],
            "tool_result": 1 <= self.tool_result[0] <= self.tool_result[1],
            "output_median": 1 <= self.output_median <= self.output_p95,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"AgenticWorkload: invalid {', '.join(bad)} (positive sizes, low <= high ranges, "
                             f"output_median <= output_p95, arrival_rate > 0)")

    @classmethod
    def at_scale(cls, scale: str, *, vocab_size: int, **fields) -> "AgenticWorkload":
        """The default workload at `scale` (a name in SCALES), then `fields` as given (in tokens,
        not scaled): `at_scale("small", vocab_size=1024, sessions=2)`."""
        if scale not in SCALES:
            raise ValueError(f"unknown workload scale {scale!r}; valid scales: {', '.join(SCALES)}")
        s = SCALES[scale]
        scaled = cls(vocab_size=vocab_size, sessions=s.sessions, turns=s.turns).scaled(s.lengths)
        return dataclasses.replace(scaled, **fields)

    def scaled(self, factor: float) -> "AgenticWorkload":
        """This workload with every token length x `factor`, rounded; a length stays >= 1 (the
        system prompt may be 0), so ranges keep low <= high and the median stays <= the P95."""
        if not factor > 0:
            raise ValueError(f"AgenticWorkload.scaled: factor must be > 0, got {factor}")

        def length(n: int) -> int:
            return max(1, round(n * factor))

        return dataclasses.replace(
            self, system_prompt=length(self.system_prompt) if self.system_prompt else 0,
            context=(length(self.context[0]), length(self.context[1])),
            tool_result=(length(self.tool_result[0]), length(self.tool_result[1])),
            output_median=length(self.output_median), output_p95=length(self.output_p95))

    def describe(self) -> str:
        """One line: "8 sessions x 3 turns; system prompt 2000, first contexts 5000-131000, ..."."""
        return (f"{self.sessions} sessions x {self.turns} turns; system prompt {self.system_prompt}, first contexts "
                f"{self.context[0]}-{self.context[1]}, tool results {self.tool_result[0]}-{self.tool_result[1]}, "
                f"outputs median {self.output_median} / P95 {self.output_p95} tokens")

    def output_length(self, rng: random.Random) -> int:
        sigma = math.log(self.output_p95 / self.output_median) / _Z95
        return max(1, round(self.output_median * math.exp(sigma * rng.gauss(0.0, 1.0))))

    def build(self) -> tuple[list[int], list[Session]]:
        """(the shared system prompt, the sessions in arrival order)."""
        rng = random.Random(self.seed)

        vocab = range(self.vocab_size)

        def tokens(n):
            return rng.choices(vocab, k=n)

        system = tokens(self.system_prompt)
        sessions, clock = [], 0.0
        low, high = self.context
        for _ in range(self.sessions):
            clock += rng.expovariate(self.arrival_rate)
            context = round(math.exp(rng.uniform(math.log(low), math.log(high))))
            turns = [Turn(tokens(context), self.output_length(rng))]
            for _ in range(self.turns - 1):
                turns.append(Turn(tokens(rng.randint(*self.tool_result)), self.output_length(rng)))
            sessions.append(Session(clock, turns))
        return system, sessions
