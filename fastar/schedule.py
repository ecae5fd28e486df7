"""The Self-Forcing few-step flow-matching schedule.

Causal Wan checkpoints are distilled for a handful of steps, listed as timesteps on a
1000-step grid (default 1000, 750, 500, 250). With ``warp`` each listed timestep is mapped
onto the shifted scheduler (sigma' = shift*s / (1 + (shift-1)*s), s = t/1000), which gives
the timesteps the models were trained on: 1000, 937.5, 833.3, 625 at shift 5.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import FastARError


@dataclass(frozen=True)
class FlowMatchSchedule:
    timesteps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0)
    shift: float = 5.0
    warp: bool = True

    def __post_init__(self):
        ts = tuple(float(t) for t in self.timesteps)
        object.__setattr__(self, "timesteps", ts)
        if not ts:
            raise FastARError("timesteps: at least one denoising step is needed")
        if any(not 0 < t <= 1000 for t in ts):
            raise FastARError(f"timesteps must lie in (0, 1000], got {list(ts)}")
        if any(a <= b for a, b in zip(ts, ts[1:])):
            raise FastARError(f"timesteps must be strictly decreasing, got {list(ts)}")
        if not self.shift > 0:
            raise FastARError(f"shift must be > 0, got {self.shift}")

    @classmethod
    def parse(cls, text: str, shift: float = 5.0, warp: bool = True) -> "FlowMatchSchedule":
        """From a comma-separated list such as ``"1000,750,500,250"``."""
        try:
            ts = tuple(float(t) for t in text.replace(" ", "").split(",") if t)
        except ValueError:
            raise FastARError(f"timesteps must be comma-separated numbers, got {text!r}") from None
        return cls(ts, shift, warp)

    @classmethod
    def from_sigmas(cls, sigmas) -> "FlowMatchSchedule":
        """The steps of a ComfyUI SIGMAS list (noise levels in (0, 1], the model's own shift already
        applied), without the final 0 that ends it."""
        return cls(tuple(1000.0 * float(s) for s in sigmas), shift=1.0, warp=False)

    def sigmas(self) -> list[float]:
        """Noise level of each step, sigma in (0, 1]; the model's timestep is 1000*sigma."""
        out = []
        for t in self.timesteps:
            s = t / 1000.0
            out.append(self.shift * s / (1 + (self.shift - 1) * s) if self.warp else s)
        return out
