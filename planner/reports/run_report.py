"""The run report (JSON): per-step times and losses, throughput, measured peak memory per rank.

The runtime writes it (runtime/report.py gathers the figures); `tessera validate` reads it.
Standard library only.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cost_models.errors import PlanFileError

REPORT_VERSION = 1


@dataclass(frozen=True)
class RunReport:
    """What one ``python -m runtime`` run measured; the input of ``tessera validate``.

    Example::

        report = RunReport.load("run.json")
        print(report.samples_per_s, report.peak_mem_bytes)
    """

    plan_fingerprint: str
    world_size: int
    device: str
    global_batch_size: int
    start_step: int
    step_ms: tuple[float, ...]  # per timed step, slowest rank (CPU: the memory-profiled last step is untimed)
    losses: tuple[float, ...]
    peak_mem_bytes: tuple[int, ...]  # per rank
    memory_measure: str
    held_mem_bytes: tuple[int, ...] = ()  # per rank, CPU: what the runtime holds (runtime/memory.py)
    host_swap_bytes: tuple[int, ...] = ()  # per rank: saved activations copied to the host in the last step
    # per rank: bytes its spatial halo exchanges sent in the last step, forward halos (those of
    # recomputed regions twice) and halo gradients back to their owners; 0 without a spatial stage
    halo_bytes_sent: tuple[int, ...] = ()
    warmup_steps: int = 1
    # per rank: bytes its pipeline sends posted in the last step (activations forward, gradients back)
    p2p_bytes_sent: tuple[int, ...] = ()
    # per rank, when any stage offloads its optimizer: master weights and optimizer state held in
    # host memory and in --nvme-dir after the last step (runtime/stage_optimizer.py)
    optimizer_host_bytes: tuple[int, ...] = ()
    optimizer_nvme_bytes: tuple[int, ...] = ()
    # per rank, its own wall time of each step timed in step_ms (which keeps the slowest rank's)
    rank_step_ms: tuple[tuple[float, ...], ...] = ()
    # per rank, CPU only: of each step timed in rank_step_ms, the wall time its compute actions took
    # (F, B, I, W, the optimizer step); the rest of its step it was idle
    rank_busy_ms: tuple[tuple[float, ...], ...] = ()
    # per rank, CPU only: per "stage:kind" (e.g. "1:B") of its compute actions, the median wall time of one;
    # under "post", per message (a tensor's send or receive) the wall time of the communication runs apart from
    # their waits: posting, packing and delivering messages
    rank_action_ms: tuple[dict[str, float], ...] = ()
    schema_version: int = REPORT_VERSION

    @property
    def timed_ms(self) -> tuple[float, ...]:
        """Step times after the warm-up steps (all of them if the run is that short)."""
        return self._after_warmup(self.step_ms)

    @property
    def median_step_ms(self) -> float:
        return statistics.median(self.timed_ms) if self.timed_ms else float("nan")

    @property
    def rank_median_step_ms(self) -> tuple[float, ...]:
        """Per rank, the median of its own step times after the warm-up steps (empty if not recorded)."""
        return tuple(statistics.median(self._after_warmup(times)) if times else float("nan")
                     for times in self.rank_step_ms)

    @property
    def rank_median_busy_ms(self) -> tuple[float, ...]:
        """Per rank, the median of its busy time per step (its compute actions) after the warm-up steps (empty
        if not recorded)."""
        return tuple(statistics.median(self._after_warmup(busies)) for busies in self.rank_busy_ms if busies)

    @property
    def rank_idle_fraction(self) -> tuple[float, ...]:
        """Per rank, the median over timed steps of its idle share (1 - busy / its step); empty if not
        recorded."""
        return tuple(statistics.median(1.0 - busy / step for busy, step in zip(
            self._after_warmup(busies), self._after_warmup(steps)) if step > 0)
                     for busies, steps in zip(self.rank_busy_ms, self.rank_step_ms))

    @property
    def bubble_fraction(self) -> float | None:
        """The median over timed steps of the job's idle share, 1 - (sum of busy) / (sum of rank steps);
        None if not recorded."""
        if not self.rank_busy_ms:
            return None
        busy = zip(*(self._after_warmup(times) for times in self.rank_busy_ms))
        steps = zip(*(self._after_warmup(times) for times in self.rank_step_ms))
        return statistics.median(1.0 - sum(b) / sum(t) for b, t in zip(busy, steps) if sum(t) > 0)

    def _after_warmup(self, times: tuple[float, ...]) -> tuple[float, ...]:
        return times[self.warmup_steps:] or times

    @property
    def samples_per_s(self) -> float:
        timed = self.timed_ms
        return self.global_batch_size * len(timed) / sum(timed) * 1e3 if timed else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["samples_per_s"] = self.samples_per_s
        data["median_step_ms"] = self.median_step_ms
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunReport:
        if data.get("schema_version") != REPORT_VERSION:
            raise PlanFileError(f"run report schema_version {data.get('schema_version')!r} is not "
                                f"{REPORT_VERSION}; re-run `python -m runtime ... --report`")
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: _frozen(v) for k, v in data.items() if k in fields}
        return cls(**values)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RunReport:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except OSError as error:
            raise PlanFileError(f"cannot read run report {str(path)!r}: {error.strerror}") from error
        except (json.JSONDecodeError, TypeError) as error:
            raise PlanFileError(f"run report {str(path)!r} is malformed ({error}); re-run with "
                                f"--report") from error


def _frozen(value: Any) -> Any:
    """JSON lists, nested ones too, as tuples."""
    return tuple(_frozen(item) for item in value) if isinstance(value, list) else value
