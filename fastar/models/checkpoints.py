"""The published causal Wan 2.1 checkpoints: which entry of the file their own inference reads, and
the sampling each was trained for, as each project's training, inference code and configs have them.

``Sampling`` is written into a converted file's metadata (``SAMPLING_METADATA_KEY``) and read back by
``checkpoint_sampling``, so a sampler can take a checkpoint's block size and steps from the file.
Its ``timesteps`` and ``shift`` are in the terms of this package's ``FlowMatchSchedule``: the listed
steps are warped by ``shift`` (a shift of 1 keeps them as listed, as CausVid samples).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import FastARError
from ..schedule import FlowMatchSchedule

SAMPLING_METADATA_KEY = "fastar.sampling"
CONFIG_METADATA_KEY = "fastar.wan_config"  # a converted or saved file's WanConfig, as JSON
FOUR_STEPS = (1000.0, 750.0, 500.0, 250.0)


@dataclass(frozen=True)
class Sampling:
    """How a causal checkpoint samples: latent frames per autoregressive block, its denoising steps."""

    frames_per_block: int
    timesteps: tuple[float, ...]
    shift: float
    checkpoint: str | None = None  # the known checkpoint these settings are from, if any

    def __post_init__(self):
        object.__setattr__(self, "timesteps", tuple(float(t) for t in self.timesteps))
        if isinstance(self.frames_per_block, bool) or not isinstance(self.frames_per_block, int) \
                or self.frames_per_block < 1:
            raise FastARError(f"frames per block must be a positive integer, got {self.frames_per_block!r}")
        self.schedule()  # the steps and shift are a valid schedule

    def schedule(self) -> FlowMatchSchedule:
        return FlowMatchSchedule(self.timesteps, self.shift)

    def to_json(self) -> str:
        return json.dumps({"checkpoint": self.checkpoint, "frames_per_block": self.frames_per_block,
                           "timesteps": list(self.timesteps), "shift": self.shift})

    @classmethod
    def from_json(cls, text: str) -> "Sampling":
        try:
            d = json.loads(text)
            return cls(d["frames_per_block"], tuple(d["timesteps"]), float(d["shift"]), d.get("checkpoint"))
        except (ValueError, KeyError, TypeError) as exc:
            raise FastARError(f"unreadable {SAMPLING_METADATA_KEY} metadata {text[:200]!r}: {exc}") from None

    def describe(self) -> str:
        steps = ",".join(f"{t:g}" for t in self.timesteps)
        return f"{self.frames_per_block} frame{'s' if self.frames_per_block > 1 else ''} per block, " \
               f"timesteps {steps}, shift {self.shift:g}"


@dataclass(frozen=True)
class KnownCheckpoint:
    name: str
    repo: str              # the GitHub repository whose code this was read from
    key: str | None        # the entry its inference loads (None: a flat safetensors file)
    sampling: Sampling
    lora_key: str | None = None      # the entry of its LoRA file holding the generator's adapters
    lora_alpha: float | None = None  # the LoRA alpha its adapter config sets (the scale is alpha / rank)


def _known(name, repo, key, frames, timesteps=FOUR_STEPS, shift=5.0, **lora) -> KnownCheckpoint:
    return KnownCheckpoint(name, repo, key, Sampling(frames, timesteps, shift, name), **lora)


KNOWN_CHECKPOINTS = {c.name: c for c in (
    # inference.py --use_ema (README); configs/self_forcing_dmd.yaml: 3 frames, warped 1000/750/500/250, shift 5
    _known("self-forcing", "guandeh17/Self-Forcing", "generator_ema", 3),
    # minimal_inference/autoregressive_inference.py reads 'generator'; configs/wan_causal_dmd.yaml: 3 frames,
    # 1000/757/522 (+0) not warped
    _known("causvid", "tianweiy/CausVid", "generator", 3, (1000.0, 757.0, 522.0), 1.0),
    # LongLive 1.0 configs/longlive_inference.yaml: use_ema false, 3 frames, warped 4 steps at shift 5, and a
    # LoRA (rank 256, alpha 256) on every linear layer of the blocks, saved as 'generator_lora'
    _known("longlive", "NVlabs/LongLive", "generator", 3, lora_key="generator_lora", lora_alpha=256.0),
    # README: the chunk-wise model runs without --use_ema, the frame-wise one with it
    _known("causal-forcing-chunkwise", "thu-ml/Causal-Forcing", "generator", 3),
    _known("causal-forcing-framewise", "thu-ml/Causal-Forcing", "generator_ema", 1),
    # README --use_ema; configs/rolling_forcing_dmd.yaml: 3 frames, warped 1000/800/600/400/200, shift 5
    _known("rolling-forcing", "TencentARC/RollingForcing", "generator_ema", 3,
           (1000.0, 800.0, 600.0, 400.0, 200.0)),
    # a safetensors file; release_server.py: 3 frames, 1000/750/500/250 warped at shift 5 (the config's
    # 1000/937/833/625), then a fifth pass at timestep 0, which the pack's samplers do not run
    _known("krea-realtime-14b", "krea-ai/realtime-video", None, 3),
)}


def known_checkpoint(name: str) -> KnownCheckpoint:
    if name not in KNOWN_CHECKPOINTS:
        raise FastARError(f"unknown checkpoint {name!r}; known: {', '.join(KNOWN_CHECKPOINTS)}")
    return KNOWN_CHECKPOINTS[name]
