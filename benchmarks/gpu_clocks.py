"""The GPU's SM clock and power draw while a benchmark runs, sampled by `nvidia-smi` in the background.

A decode step's roofline share assumes the copy bandwidth that a lone copy kernel reaches. If a
whole step draws the card to its power limit, its clocks drop and that bandwidth may not be there
to reach. `decode_profile.py` prints these samples beside the step time so that a measurement says
whether it ran at full clocks. `stand_ins.py`'s runs (H200, 2026-11-27) hinted at it: steps fed other
activation values (uninitialised memory, queries neither normed nor rotated) ran faster than the
launches they removed could explain.

Usage:
    with GpuClocks() as clocks:
        run()
    print(clocks.summary_line())   # None-safe: says so when nvidia-smi gave nothing
"""

from __future__ import annotations

import statistics
import subprocess
from dataclasses import dataclass

#: the queried fields, in the order `parse_samples` reads them (stable names across drivers)
FIELDS = ("clocks.sm", "clocks.max.sm", "power.draw", "power.limit")


@dataclass
class ClockSummary:
    """Medians and extremes of the samples: SM clock and its maximum in MHz, power in W."""

    samples: int
    sm_median: float
    sm_min: float
    sm_max_clock: float
    power_median: float
    power_max: float
    power_limit: float

    def line(self) -> str:
        return (f"GPU during the timed runs ({self.samples} samples): SM clock median {self.sm_median:.0f} MHz "
                f"(min {self.sm_min:.0f}, the card's max {self.sm_max_clock:.0f}), power median "
                f"{self.power_median:.0f} W (max {self.power_max:.0f}, limit {self.power_limit:.0f})")


def parse_samples(text: str) -> ClockSummary | None:
    """The summary of `nvidia-smi --query-gpu=<FIELDS> --format=csv,noheader,nounits` lines;
    lines that are not four numbers (``[N/A]``, warnings) are skipped; None without any."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            values = [float(p) for p in parts]
        except ValueError:
            continue
        if len(values) == len(FIELDS):
            rows.append(values)
    if not rows:
        return None
    sm, sm_max, power, limit = (list(column) for column in zip(*rows))
    return ClockSummary(len(rows), statistics.median(sm), min(sm), max(sm_max), statistics.median(power), max(power),
                        max(limit))


def nvidia_smi_id(properties) -> str:
    """The `nvidia-smi --id` of a GPU from its `torch.cuda.get_device_properties`: ``GPU-<uuid>``,
    which names the same card whatever ``CUDA_VISIBLE_DEVICES`` renumbers (a CUDA index would not;
    torch prints the UUID without nvidia-smi's prefix)."""
    uuid = str(properties.uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


class GpuClocks:
    """Context manager: `nvidia-smi` samples GPU `device` (an `nvidia_smi_id`, or nvidia-smi's own
    index) every `interval_ms` while the block runs (`command` names the executable; tests pass a
    stand-in). Never raises for a missing or failing `nvidia-smi`: `summary` is then None."""

    def __init__(self, device: str | int = 0, interval_ms: int = 50, command: str = "nvidia-smi") -> None:
        if interval_ms < 1:
            raise ValueError(f"GpuClocks: interval_ms must be >= 1, got {interval_ms}")
        self.args = [command, f"--id={device}", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
                     f"-lms={interval_ms}"]
        self.summary: ClockSummary | None = None
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> GpuClocks:
        try:
            self._process = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._process = None
        return self

    def __exit__(self, *exc) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            out, _ = self._process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            out, _ = self._process.communicate()
        self.summary = parse_samples(out or "")

    def summary_line(self) -> str:
        """`ClockSummary.line`, or why there is none."""
        if self.summary is None:
            return "GPU clocks: no samples (nvidia-smi missing or silent)"
        return self.summary.line()
