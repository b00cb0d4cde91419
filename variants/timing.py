"""Per-stage timing of `blaze edit`: wall seconds, CPU seconds of this process, and the machine's load.

Why CPU seconds beside wall seconds: on a shared machine (the 2-core CI runner, a laptop doing other work) the
wall time of a stage depends on what else runs; the CPU seconds of this process (all its threads) mostly do
not, so a before/after comparison of the same stage stays meaningful. The 1-minute load average at the end of
each stage says how crowded the machine was (on 2 cores, a load above 2 means the stage shared them).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field


def load_average() -> float | None:
    """The 1-minute load average, or None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


@dataclass(frozen=True)
class StageTime:
    """One stage: its name, wall and CPU seconds, and the load average when it ended."""

    name: str
    wall_s: float
    cpu_s: float
    load: float | None

    def text(self) -> str:
        """``name 12.3 s (cpu 20.1 s, load 1.9)``."""
        load = "" if self.load is None else f", load {self.load:.1f}"
        return f"{self.name} {self.wall_s:.1f} s (cpu {self.cpu_s:.1f} s{load})"


@dataclass
class StageTimes:
    """The stages of one run, in order, and the run's start (for the total)."""

    stages: list[StageTime] = field(default_factory=list)
    started_wall: float = field(default_factory=time.perf_counter)
    started_cpu: float = field(default_factory=time.process_time)

    last_wall: float = field(default_factory=time.perf_counter)
    last_cpu: float = field(default_factory=time.process_time)

    def mark(self, name: str) -> StageTime:
        """End stage ``name`` now: it ran since the previous mark (or the start). Marks, not a context
        manager, so timing a long function takes one line per stage and no re-indented code."""
        wall, cpu = time.perf_counter(), time.process_time()
        stage = StageTime(name, wall - self.last_wall, cpu - self.last_cpu, load_average())
        self.stages.append(stage)
        self.last_wall, self.last_cpu = wall, cpu
        return stage

    def total(self) -> StageTime:
        """The whole run so far as one stage named ``total``."""
        return StageTime("total", time.perf_counter() - self.started_wall, time.process_time() - self.started_cpu,
                         load_average())

    def summary(self) -> str:
        """One line: every stage then the total, e.g. ``timing: load 3.1 s (cpu 2.0 s, load 1.2); …``."""
        return "timing: " + "; ".join(s.text() for s in [*self.stages, self.total()])

    def to_dict(self) -> dict[str, dict[str, float | None]]:
        """Stage name → wall_s, cpu_s, load (plain data for reports and benchmarks)."""
        return {s.name: {"wall_s": round(s.wall_s, 2), "cpu_s": round(s.cpu_s, 2), "load": s.load}
                for s in [*self.stages, self.total()]}
