"""The pack's own world model: a small causal Wan 2.1 whose frames are steered by actions, not text.

It is the library's ``WanModel`` with three changes, all configuration: no cross-attention (no text),
an action module in its first blocks where Matrix-Game 2.0 puts its own (after the cross-attention,
before the FFN), and a fixed latent (``WorldSpec``: each latent frame is ``frames_per_latent`` video
frames pixel-unshuffled, no autoencoder). The rollout's ``context`` is the actions, one row per latent
frame (its video frames' actions side by side); the model integrates them into camera poses
(``fastar.actions.integrate``, the rule the ground truth follows) and gives each token the RoPE of
where it lies in the world (x, y over the photograph) rather than on the screen, as pose-aware memory
models place their frames: a place seen before is found again by where it is, whatever route led back.
Its screen-placed twin (``WorldSpec.placement = "screen"``) places them on the screen and in time, as
Matrix-Game 2.0 and the Wan video models do, where a returning place looks new to attention: what a cache
recalls on it is what FAST-AR can give those models.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import FastARError
from ..actions import ActionSpec, integrate
from ..rollout import Rollout
from .checkpoints import CONFIG_METADATA_KEY, SAMPLING_METADATA_KEY, Sampling
from .rope import rope_at
from .wan import WanConfig, WanModel

WORLD_METADATA_KEY = "fastar.world"
PLACEMENTS = ("world", "screen")
# how the world model is trained to sample (Matrix-Game 2.0's chunks, steps and shift)
WORLD_SAMPLING = Sampling(3, (1000.0, 666.0, 333.0), 5.0, "fastar-world")


@dataclass(frozen=True)
class WorldSpec:
    """A world model's frames, latent and actions."""
    actions: ActionSpec = field(default_factory=ActionSpec)
    view: int = 64               # video frames are view x view RGB
    unshuffle: int = 4           # latent pixels are unshuffle x unshuffle video pixels
    frames_per_latent: int = 4   # video frames stacked into one latent frame
    placement: str = "world"     # a token's RoPE: where it lies in the world, or ("screen") on the screen and
    #                              in time, as Matrix-Game 2.0 and the Wan video models place theirs

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise FastARError(f"a world places its tokens by {' or '.join(PLACEMENTS)}, not {self.placement!r}")

    @property
    def channels(self) -> int:
        return 3 * self.unshuffle ** 2 * self.frames_per_latent

    @property
    def condition_dim(self) -> int:
        """The action module's condition per latent frame: each video frame's actions and its pose
        about the latent frame's mean, then the mean's zoom."""
        return self.frames_per_latent * (self.actions.width + 3) + 1

    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        """Video frames [B, 3, N, view, view] in [-1, 1] (N a multiple of ``frames_per_latent``) ->
        latent [B, channels, N / frames_per_latent, view / unshuffle, view / unshuffle]."""
        b, c, n, h, w = frames.shape
        k = self.frames_per_latent
        if n % k or (h, w) != (self.view, self.view) or c != 3:
            raise FastARError(f"world frames must be [B, 3, N, {self.view}, {self.view}] with N a multiple of {k}, "
                              f"got {tuple(frames.shape)}")
        x = frames.reshape(b, 3, n // k, k, h, w).permute(0, 2, 1, 3, 4, 5).reshape(b * (n // k), 3 * k, h, w)
        x = F.pixel_unshuffle(x, self.unshuffle)
        return x.reshape(b, n // k, *x.shape[1:]).transpose(1, 2)

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """``encode``'s inverse: latent [B, channels, T, h, w] -> video frames [B, 3, T * frames_per_latent,
        view, view]."""
        b, c, t, h, w = latent.shape
        k = self.frames_per_latent
        x = F.pixel_shuffle(latent.transpose(1, 2).reshape(b * t, c, h, w), self.unshuffle)
        x = x.reshape(b, t, 3, k, *x.shape[-2:]).permute(0, 2, 1, 3, 4, 5)
        return x.reshape(b, 3, t * k, *x.shape[-2:])

    def context(self, actions: torch.Tensor) -> torch.Tensor:
        """Actions per video frame [B, N, width] -> the rollout's context [B, N / frames_per_latent,
        frames_per_latent * width]: one row per latent frame."""
        b, n, width = actions.shape
        if n % self.frames_per_latent or width != self.actions.width:
            raise FastARError(f"actions must be [B, N, {self.actions.width}] with N a multiple of "
                              f"{self.frames_per_latent}, got {tuple(actions.shape)}")
        return actions.reshape(b, n // self.frames_per_latent, -1)

    def to_json(self) -> str:
        return json.dumps({"actions": self.actions.to_dict(), "view": self.view, "unshuffle": self.unshuffle,
                           "frames_per_latent": self.frames_per_latent, "placement": self.placement})

    @classmethod
    def from_json(cls, text: str) -> "WorldSpec":
        try:
            d = json.loads(text)
            return cls(ActionSpec.from_dict(d["actions"]), d["view"], d["unshuffle"], d["frames_per_latent"],
                       d.get("placement", "world"))  # files from before the screen-placed twin
        except (ValueError, KeyError, TypeError) as exc:
            raise FastARError(f"unreadable {WORLD_METADATA_KEY} metadata {text[:200]!r}: {exc}") from None


@dataclass(frozen=True)
class WorldConfig(WanConfig):
    """Wan's configuration and the first ``action_layers`` blocks that carry an action module."""
    action_layers: int = 4


def world_config(spec: WorldSpec, *, dim: int = 256, ffn_dim: int = 1024, num_heads: int = 4, num_layers: int = 8,
                 action_layers: int = 4) -> WorldConfig:
    """The world model's Wan configuration: one token per latent pixel, so a token's values (3 colours x
    unshuffle^2 pixels x frames_per_latent frames) fit through the width whole."""
    return WorldConfig(dim=dim, ffn_dim=ffn_dim, num_heads=num_heads, num_layers=num_layers, in_dim=spec.channels,
                       out_dim=spec.channels, text_dim=0, freq_dim=128,  # no text: actions (``context_dim``)
                       patch_size=(1, 1, 1), cross_attn_norm=False, action_layers=action_layers)


class WorldActionModule(nn.Module):
    """A block's action input: every token's hidden state beside its frame's condition, through an MLP,
    added to the residual stream (the per-token path of Matrix-Game 2.0's action module)."""

    def __init__(self, dim: int, condition_dim: int, eps: float):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(dim + condition_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim))

    def forward(self, x: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        """x [B, F, S, C]; condition [B, F, condition_dim]."""
        c = condition.to(x.dtype)[:, :, None].expand(-1, -1, x.shape[2], -1)
        return x + self.mlp(torch.cat([self.norm(x), c], -1))


class WorldModel(WanModel):
    """A causal Wan world model (see the module's docstring); the rollout's chunk model."""

    head_parallel = False
    context_input = None  # no cross-attention: actions steer it through its action modules

    def __init__(self, cfg: WorldConfig, spec: WorldSpec):
        if not isinstance(cfg, WorldConfig) or cfg.in_dim != spec.channels:
            raise FastARError(f"WorldModel: the config must be a WorldConfig with in_dim = the world's latent "
                              f"channels ({spec.channels})")
        super().__init__(cfg, lambda i: WorldActionModule(cfg.dim, spec.condition_dim, cfg.eps)
                         if i < cfg.action_layers else None)
        self.spec = spec

    @property
    def vae_scale(self) -> int:
        """Video pixels per latent pixel (the rollout's height and width are the video's)."""
        return self.spec.unshuffle

    @property
    def context_dim(self) -> int:
        """A context row is one latent frame's actions: ``frames_per_latent`` video frames' rows."""
        return self.spec.frames_per_latent * self.spec.actions.width

    @property
    def context_len(self):
        return None  # one row per latent frame, never padded

    def validate(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> None:
        if context.shape[0] != 1 or x.shape[0] != 1:
            raise FastARError(f"the world model rolls out one trajectory at a time (batch 1), got "
                              f"{x.shape[0]} latents and {context.shape[0]} action rows")
        super().validate(x, t, context)

    def steering(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The condition of every latent frame of the rollout, from its actions ``context`` [B, T,
        frames_per_latent * width]: the mean camera pose of each latent frame [B, T, 3] and the action
        module's condition [B, T, condition_dim]. A function of the actions alone, so the attention state
        keeps it for the rollout (``FastARAttention.of_context``)."""
        spec, k = self.spec, self.spec.frames_per_latent
        b, t, _ = context.shape
        poses = integrate(context.float().reshape(b, t * k, spec.actions.width), spec.actions).view(b, t, k, 3)
        mean = poses.mean(2)
        d = poses - mean[:, :, None]
        about = torch.stack([d[..., 0] / 16, d[..., 1] / 16, d[..., 2] * 10], -1)  # no host tensor: graph-safe
        condition = torch.cat([context.float().view(b, t, k, -1), about], -1).flatten(2)
        return mean, torch.cat([condition, 5 * mean[..., 2:]], -1).to(self.dtype)

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, *,
                frame_offset: int | torch.Tensor = 0, attention=None, fill_cache: bool = False):
        """Flow prediction for a chunk x [1, C, F, h, w] whose first latent frame is ``frame_offset``,
        steered by the rollout's actions ``context`` [1, T, frames_per_latent * width] (T at least the
        chunk's last frame + 1)."""
        from ..attention import FastARAttention

        self.validate(x, t, context)
        f = x.shape[2]
        if isinstance(frame_offset, int) and frame_offset + f > context.shape[1]:
            raise FastARError(f"the actions cover {context.shape[1]} latent frames; the chunk at frame "
                              f"{frame_offset} needs {frame_offset + f}")
        attention = attention if attention is not None else FastARAttention()
        mean, condition = attention.of_context(context, self.steering)
        frames = torch.arange(f, device=x.device, dtype=torch.float64) + frame_offset
        rows = frames.long()
        return self.run(x, t, mean.index_select(1, rows), condition.index_select(1, rows), frames, attention,
                        fill_cache)

    def rollout(self, context: torch.Tensor, start: torch.Tensor, *, cache=None, ann=None, seed: int = 0,
                cuda_graphs: bool = True) -> Rollout:
        """The rollout of the actions ``context`` [1, T, context_dim] (``WorldSpec.context``), whose first
        latent frames are ``start`` [1, C, S, h, w] (the frames shown first, encoded: cached by clean passes),
        the rest sampled as the world was trained, under ``cache`` and ``ann``. What the World Sampler,
        World Play and the benchmarks run."""
        spec = self.spec
        return Rollout(self, context.to(self.dtype), frames=context.shape[1], height=spec.view, width=spec.view,
                       chunk_frames=WORLD_SAMPLING.frames_per_block, schedule=WORLD_SAMPLING.schedule(), cache=cache,
                       ann=ann, seed=seed, cuda_graphs=cuda_graphs, start=start.to(self.dtype))

    def world_rope(self, poses: torch.Tensor, frames: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        """RoPE tables [F * h * w, head_dim / 2, 2] for tokens at frames ``frames`` [F] (float64) whose
        cameras stand at ``poses`` [F, 3]: time by frame, height and width by the token's place in the
        world, in tokens of the photograph at zoom 1 (a screen-placed world: by its row and column)."""
        h, w = hw
        if self.spec.placement == "screen":
            y = torch.arange(h, device=poses.device, dtype=torch.float64).expand(len(frames), -1)
            x = torch.arange(w, device=poses.device, dtype=torch.float64).expand(len(frames), -1)
        else:
            ph, pw = self.config.patch_size[1:]
            size = self.spec.unshuffle * ph  # video pixels a token spans (square patches)
            s = poses[:, 2].double().exp()
            rows = (torch.arange(h, device=poses.device, dtype=torch.float64) + 0.5) * size - self.spec.view / 2
            cols = (torch.arange(w, device=poses.device, dtype=torch.float64) + 0.5) * size - self.spec.view / 2
            y = (poses[:, 1].double()[:, None] + rows[None] * s[:, None]) / size  # [F, h]
            x = (poses[:, 0].double()[:, None] + cols[None] * s[:, None]) / size  # [F, w]
        positions = torch.stack([frames[:, None, None].expand(-1, h, w), y[:, :, None].expand(-1, -1, w),
                                 x[:, None, :].expand(-1, h, -1)], -1)
        return rope_at(self.config.head_dim, positions.reshape(-1, 3))

    def run(self, x: torch.Tensor, t: torch.Tensor, poses: torch.Tensor, condition: torch.Tensor,
            frames: torch.Tensor, attention, fill_cache: bool = False):
        """The forward over latent frames x [1, C, F, h, w] at frame indices ``frames`` [F], their mean
        camera poses [1, F, 3] and conditions [1, F, condition_dim]: the frames need not be one chunk
        (training runs many trajectories' frames as one sequence under a mask of its own)."""
        tokens, e, e0, grid = self.embed(x, t)
        freqs = self.world_rope(poses[0], frames, grid[1:])
        out = self.run_blocks(tokens, e, e0, freqs, attention, fill_cache, action=condition)
        return out if fill_cache else self.unpatchify(out, grid)


def save_world(model: WorldModel, path, sampling, *, training: dict | None = None,
               dtype: torch.dtype = torch.bfloat16) -> None:
    """Write a world model as ``load_wan`` reads it: the weights in ``dtype``, with its config, world
    (``WORLD_METADATA_KEY``), sampling (frames per chunk, timesteps, shift) and, where given, how it was
    trained, in the metadata."""
    from safetensors.torch import save_file


    metadata = {CONFIG_METADATA_KEY: json.dumps(model.config.to_dict()), WORLD_METADATA_KEY: model.spec.to_json(),
                SAMPLING_METADATA_KEY: sampling.to_json()}
    if training is not None:
        metadata["fastar.training"] = json.dumps(training)
    save_file({k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}, str(path),
              metadata=metadata)
