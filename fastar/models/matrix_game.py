"""Matrix-Game 2.0 (Skywork): Wan 2.1 1.3B steered by keyboard and mouse, as the library's ``WanModel``.

Three things beside Wan 2.1 text-to-video, each read off a checkpoint's keys (``detect``):

- an image-to-video input (``in_dim`` 36): each chunk's 16 noise channels beside a 4-channel mask (1 on the
  first latent frame) and the start image's VAE latent (that of the image followed by black frames), which
  ``MatrixGameRun`` slices per chunk;
- CLIP-vision tokens in place of text: ViT-H/14's 257 penultimate tokens through ``img_emb`` are the
  cross-attention's context (``MatrixGameModel.context_input``);
- an action module (``MatrixGameActionModule``) in the first blocks, after the cross-attention and before the FFN.

The action module. Actions come per video frame (``1 + 4 (T - 1)`` rows for T latent frames); latent frame i
reads the 12 rows ``[4i - 12, 4i)`` (``WINDOW`` latent frames of 4), the stream padded in front with copies
of its first row. Mouse ([pitch, yaw] per row): every token's hidden state beside its frame's window,
through an MLP, gives q, k, v of a temporal self-attention per spatial position over the last
``local_frames`` latent frames, projected back and added. Keyboard: each frame's window of embedded keys
is one token (its K, V); every video token's query attends the keyboard tokens of the last ``local_frames``
frames, projected back and added. Both run on 64-channel heads whose first 8 channels carry RoPE on the
latent frame's index (theta 256), after RMS norms whose weights the model never applies.

Each action block keeps its K / V per latent frame in rolling caches (``ActionCaches``): a ring of
``local_frames`` slots that every forward of a chunk writes (the clean pass's are kept) and that is read by
frame index on the device, so a chunk's forwards replay from a CUDA graph as the rest of the rollout does.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import FastARError
from ..actions import ActionSpec
from ..rollout import Rollout
from ..schedule import FlowMatchSchedule
from .checkpoints import Sampling
from .wan import WanConfig, WanModel

MATRIX_GAME_METADATA_KEY = "fastar.matrix_game"
FRAMES_PER_LATENT = 4   # video frames per latent frame (Wan's VAE)
WINDOW = 3              # latent frames of actions each latent frame reads
HEAD_DIM = 64           # the action module's attention heads
ROPE_CHANNELS = 8       # of each head: RoPE on the frame index (the rest on a spatial extent of 1: none)
ROPE_THETA = 256.0
CONDITION_CHANNELS = 20  # the mask's 4 and the start image latent's 16


@dataclass(frozen=True)
class ActionConfig:
    """A Matrix-Game 2.0 action module's shape and its rollout's windows."""
    keyboard_dim: int            # keys per row: 4 (W, S, A, D), 2 (forward, back), 7 (Temple Run's)
    mouse_dim: int               # 2 ([pitch, yaw]) or 0 (no mouse)
    blocks: int                  # the first blocks carrying the module
    hidden: int = 1024           # its attention width (16 heads of 64)
    keyboard_hidden: int = 128   # an embedded key row
    local_frames: int | None = 6  # latent frames self- and action attention read (None: every frame)

    @property
    def heads(self) -> int:
        return self.hidden // HEAD_DIM

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Variant:
    """A published Matrix-Game 2.0 file: its actions, window and sampling."""
    name: str
    file: str
    keys: tuple[str, ...]        # the keyboard's rows, in order
    mouse: bool
    local_frames: int | None
    sampling: Sampling | None
    idle: tuple[str, ...] = ()                   # the keys a row without any holds
    aliases: tuple[tuple[str, str], ...] = ()    # action-text names standing for keys or looks

    @property
    def actions(self) -> ActionSpec:
        """Its action text's vocabulary (``fastar.actions.parse_actions``): the keys, and with a mouse the
        looks (pitch / yaw 0.1 a video frame, as it was trained around, and no more)."""
        return ActionSpec(keys=self.keys, mouse=self.mouse, idle=self.idle, aliases=self.aliases, mouse_limit=0.1)


_STEPS3, _STEPS4 = (1000.0, 666.0, 333.0), (1000.0, 750.0, 500.0, 250.0)
VARIANTS = {v.name: v for v in (
    Variant("universal", "base_distilled_model/base_distill.safetensors", ("W", "S", "A", "D"), True, 6,
            Sampling(3, _STEPS3, 5.0, "matrix-game-2-universal")),
    # driving: W / S are forward / back, A / D steer (yaw)
    Variant("gta", "gta_distilled_model/gta_keyboard2dim.safetensors", ("forward", "back"), True, 4,
            Sampling(3, _STEPS3, 5.0, "matrix-game-2-gta"),
            aliases=(("W", "forward"), ("S", "back"), ("A", "look_left"), ("D", "look_right"))),
    # one key at a time, "nomove" when none is pressed
    Variant("templerun", "templerun_distilled_model/templerun_7dim_onlykey.safetensors",
            ("nomove", "jump", "slide", "turnleft", "turnright", "leftside", "rightside"), False, 6,
            Sampling(3, _STEPS4, 5.0, "matrix-game-2-templerun"), idle=("nomove",)),
    # the foundation model: every block steered, attention over every frame; its many-step sampling is
    # not published beside it, so none is recorded
    Variant("foundation", "base_model/diffusion_pytorch_model.safetensors", ("W", "S", "A", "D"), True, None,
            None),
)}


def detect(state_dict: dict, num_heads: int | None = None) -> tuple[WanConfig, ActionConfig, Variant]:
    """A Matrix-Game 2.0 state dict's Wan config, action module and variant, read off its keys and shapes
    (keys without the ``model.`` prefix): the keyboard's width from ``keyboard_embed.0.weight``, the mouse
    from ``mouse_mlp``, the action blocks by count; every block steered is the foundation model."""
    module = "blocks.0.action_model."
    if module + "keyboard_embed.0.weight" not in state_dict or "img_emb.proj.1.weight" not in state_dict:
        raise FastARError("not a Matrix-Game 2.0 model: no blocks.0.action_model.keyboard_embed / img_emb weights")
    pe = state_dict["patch_embedding.weight"]
    dim, in_dim = pe.shape[:2]
    if in_dim != 16 + CONDITION_CHANNELS:
        raise FastARError(f"a Matrix-Game 2.0 model takes 36 input channels (noise, mask, start image); this one "
                          f"takes {in_dim}")
    layers = 1 + max(int(k.split(".")[1]) for k in state_dict if k.startswith("blocks."))
    blocks = sum(f"blocks.{i}.action_model.keyboard_embed.0.weight" in state_dict for i in range(layers))
    keyboard_dim = state_dict[module + "keyboard_embed.0.weight"].shape[1]
    mouse = module + "mouse_mlp.0.weight" in state_dict
    mouse_dim = (state_dict[module + "mouse_mlp.0.weight"].shape[1] - dim) // (WINDOW * FRAMES_PER_LATENT) \
        if mouse else 0
    hidden = state_dict[module + "proj_keyboard.weight"].shape[1]
    if blocks == layers:
        variant = VARIANTS["foundation"]
    else:
        variant = next((v for v in VARIANTS.values() if v.local_frames is not None and len(v.keys) == keyboard_dim
                        and v.mouse == mouse), None)
        if variant is None:
            raise FastARError(f"a Matrix-Game 2.0 model with {keyboard_dim} keys and {'a' if mouse else 'no'} mouse "
                              f"is none of the published variants ({', '.join(VARIANTS)})")
    heads = num_heads or dim // 128
    patch = tuple(pe.shape[2:])
    config = WanConfig(dim=dim, ffn_dim=state_dict["blocks.0.ffn.0.weight"].shape[0], num_heads=heads,
                       num_layers=layers, in_dim=in_dim,
                       out_dim=state_dict["head.head.weight"].shape[0] // math.prod(patch),
                       text_dim=state_dict["img_emb.proj.1.weight"].shape[1],
                       freq_dim=state_dict["time_embedding.0.weight"].shape[1], patch_size=patch,
                       text_len=257)
    actions = ActionConfig(keyboard_dim, mouse_dim, blocks, hidden, state_dict[module + "keyboard_embed.0.weight"]
                           .shape[0], variant.local_frames)
    return config, actions, variant


def _rms(x: torch.Tensor) -> torch.Tensor:
    """The action module's RMS norm over the head's channels (its weight is never applied)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def rope_tables(frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [F, HEAD_DIM] fp32 for latent frame indices ``frames`` [F]: pairs of adjacent channels
    rotate, the first ``ROPE_CHANNELS`` by the frame index, the rest not at all."""
    freqs = ROPE_THETA ** -(torch.arange(0, ROPE_CHANNELS, 2, device=frames.device, dtype=torch.float64) / ROPE_CHANNELS)
    angles = F.pad(frames.double()[:, None] * freqs, (0, (HEAD_DIM - ROPE_CHANNELS) // 2))
    angles = angles.repeat_interleave(2, dim=1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., F, H, HEAD_DIM] rotated by the tables [F, HEAD_DIM] (in fp32, returned in x's dtype)."""
    xf = x.float()
    pairs = xf.unflatten(-1, (-1, 2))
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], -1).flatten(-2)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class MatrixGameActionModule(nn.Module):
    """A block's Matrix-Game 2.0 action module (the module docstring); the parameter names are the
    released checkpoints'. ``index``: which of the action blocks it is (its caches' row). Its attention is
    PyTorch's SDPA, not the rollout's backend: a masked read of a few action rows, which no kernel there takes."""

    def __init__(self, dim: int, cfg: ActionConfig, index: int):
        super().__init__()
        self.cfg, self.index = cfg, index
        rows, hidden = WINDOW * FRAMES_PER_LATENT, cfg.hidden
        self.keyboard_embed = nn.Sequential(nn.Linear(cfg.keyboard_dim, cfg.keyboard_hidden), nn.SiLU(),
                                            nn.Linear(cfg.keyboard_hidden, cfg.keyboard_hidden))
        if cfg.mouse_dim:
            self.mouse_mlp = nn.Sequential(nn.Linear(dim + rows * cfg.mouse_dim, hidden), nn.GELU(approximate="tanh"),
                                           nn.Linear(hidden, hidden), nn.LayerNorm(hidden))
            self.t_qkv = nn.Linear(hidden, 3 * hidden, bias=False)
            self.img_attn_q_norm, self.img_attn_k_norm = _Unapplied(), _Unapplied()
            self.proj_mouse = nn.Linear(hidden, dim, bias=False)
        self.key_attn_q_norm, self.key_attn_k_norm = _Unapplied(), _Unapplied()
        self.mouse_attn_q = nn.Linear(dim, hidden, bias=False)
        self.keyboard_attn_kv = nn.Linear(rows * cfg.keyboard_hidden, 2 * hidden, bias=False)
        self.proj_keyboard = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, step: "ActionStep") -> torch.Tensor:
        """x [B, F, S, C] the chunk's tokens by frame, after the cross-attention's residual."""
        b, f, s, c = x.shape
        heads, caches = self.cfg.heads, step.caches
        if self.cfg.mouse_dim:
            h = x.transpose(1, 2).reshape(b * s, f, c)
            window = step.mouse.flatten(2).to(x.dtype)[:, None].expand(b, s, f, -1).reshape(b * s, f, -1)
            q, k, v = self.t_qkv(self.mouse_mlp(torch.cat([h, window], -1))).unflatten(-1, (3, heads, HEAD_DIM)) \
                .unbind(-3)                                                        # [B S, F, heads, 64]
            q, k = apply_rope(_rms(q), step.cos, step.sin), apply_rope(_rms(k), step.cos, step.sin)
            keys, values = caches.write("mouse", self.index, k, v, step.slots)   # [B S, R, heads, 64]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                                 attn_mask=step.valid)          # [B S, heads, F, 64]
            x = x + self.proj_mouse(out.permute(0, 2, 1, 3).reshape(b, s, f, -1).transpose(1, 2))
        kb = self.keyboard_embed(step.keyboard.to(x.dtype)).flatten(2)             # [B, F, 12 x 128]
        k, v = self.keyboard_attn_kv(kb).unflatten(-1, (2, heads, HEAD_DIM)).unbind(2)  # [B, F, heads, 64]
        q = self.mouse_attn_q(x).unflatten(-1, (heads, HEAD_DIM))                  # [B, F, S, heads, 64]
        q = apply_rope(_rms(q).transpose(1, 2), step.cos, step.sin).transpose(1, 2)
        keys, values = caches.write("keyboard", self.index, apply_rope(_rms(k), step.cos, step.sin), v, step.slots)
        out = F.scaled_dot_product_attention(q.reshape(b, f * s, heads, HEAD_DIM).transpose(1, 2),
                                             keys.transpose(1, 2), values.transpose(1, 2), attn_mask=step.valid)
        return x + self.proj_keyboard(out.transpose(1, 2).reshape(b, f, s, -1))


class _Unapplied(nn.Module):
    """An RMS norm's weight as the checkpoints carry it, which the model never applies."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HEAD_DIM))


class ActionCaches:
    """Every action block's rolling mouse and keyboard K / V: ``slots`` latent frames each, frame ``i`` in
    slot ``i % slots``, with the frame each slot holds (-1: none yet)."""

    def __init__(self, cfg: ActionConfig, *, batch: int, tokens: int, slots: int, device, dtype):
        shape = (cfg.blocks, slots, cfg.heads, HEAD_DIM)
        self.slots = slots
        self.frame = torch.full((slots,), -1, dtype=torch.long, device=device)
        self.store = {"keyboard": [torch.zeros(batch, *shape, device=device, dtype=dtype) for _ in range(2)]}
        if cfg.mouse_dim:
            self.store["mouse"] = [torch.zeros(batch * tokens, *shape, device=device, dtype=dtype) for _ in range(2)]

    def begin(self, frames: torch.Tensor, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A forward over latent frames ``frames`` [F] (device): their slots [F] and which slots its
        attention reads [1, slots] (the frames of the last ``window``, the forward's own included)."""
        slots = frames % self.slots
        self.frame.index_copy_(0, slots, frames)
        end = frames[-1] + 1
        valid = (self.frame >= 0) & (self.frame < end)
        if window is not None:
            valid &= self.frame >= end - window
        return slots, valid[None]

    def write(self, kind: str, block: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
        """Block ``block``'s K / V [N, F, heads, 64] of the forward's frames into their slots; returns the
        block's cache [N, slots, heads, 64] (read with ``begin``'s mask)."""
        keys, values = (t[:, block] for t in self.store[kind])
        keys.index_copy_(1, slots, k.to(keys.dtype))
        values.index_copy_(1, slots, v.to(values.dtype))
        return keys, values


@dataclass
class ActionStep:
    """What a chunk forward's action modules read: each frame's windows of key rows [B, F, 12, keys] and
    mouse rows [B, F, 12, 2] (None: no mouse), its RoPE tables, its cache slots and their mask."""
    keyboard: torch.Tensor
    mouse: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    valid: torch.Tensor
    caches: ActionCaches


class MatrixGameModel(WanModel):
    """Wan 2.1 with Matrix-Game 2.0's action module in its first ``actions.blocks`` blocks (the module
    docstring). Its forward takes the 36-channel input; ``bind`` makes the rollout's chunk model."""

    head_parallel = False
    context_input = "image"  # CLIP-vision tokens of the start image

    def __init__(self, cfg: WanConfig, actions: ActionConfig, variant: Variant | None = None):
        if cfg.in_dim != 16 + CONDITION_CHANNELS or actions.blocks > cfg.num_layers:
            raise FastARError("MatrixGameModel: the config must take 36 input channels and have at most "
                              f"{cfg.num_layers} action blocks")
        blocks = iter(range(actions.blocks))
        super().__init__(cfg, lambda i: MatrixGameActionModule(cfg.dim, actions, next(blocks)) if i < actions.blocks
                         else None)
        self.actions, self.variant = actions, variant

    def bind(self, condition: torch.Tensor, keyboard: torch.Tensor, mouse: torch.Tensor | None = None, *,
             frames: int) -> "MatrixGameRun":
        """The chunk model of one rollout of ``frames`` latent frames (``MatrixGameRun``)."""
        return MatrixGameRun(self, condition, keyboard, mouse, frames=frames)

    def rollout(self, context: torch.Tensor, condition: torch.Tensor, keyboard: torch.Tensor,
                mouse: torch.Tensor | None, *, frames: int, height: int, width: int, schedule: FlowMatchSchedule,
                cache=None, seed: int = 0) -> Rollout:
        """The rollout of ``frames`` latent frames from a start image: its CLIP-vision ``context`` [1, 257, 1280],
        its ``condition`` (``start_condition``; ``MatrixGameRun``) and every video frame's action rows (keyboard
        [1, 1 + 4 (frames - 1), keys], mouse [.., 2] or None), in chunks of 3 latent frames under ``cache``.
        What the sampler node, World Play and the benchmarks run."""
        return Rollout(self.bind(condition, keyboard, mouse, frames=frames), context.to(condition.device, self.dtype),
                       frames=frames, height=height, width=width, chunk_frames=3, schedule=schedule, cache=cache,
                       seed=seed)


def start_condition(latent: torch.Tensor) -> torch.Tensor:
    """The start-image condition [B, 20, T, h, w] ``MatrixGameRun`` takes, from the VAE latent [B, 16, T, h, w]
    (in the model's normalised space) of the start image followed by black frames: the mask's 4 channels
    (1 on latent frame 0) before it."""
    mask = torch.zeros_like(latent[:, :4])
    mask[:, :, 0] = 1
    return torch.cat([mask, latent], 1)


def _windows(rows: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
    """Each latent frame's window [B, F, 12, width] of per-video-frame ``rows`` [B, N, width]: rows
    ``[4i - 12, 4i)`` of frame i, those before the first taken as the first (those past the last as the last)."""
    idx = frames[:, None] * FRAMES_PER_LATENT - WINDOW * FRAMES_PER_LATENT \
        + torch.arange(WINDOW * FRAMES_PER_LATENT, device=rows.device)
    idx = idx.clamp(0, rows.shape[1] - 1)
    return rows[:, idx.flatten()].unflatten(1, idx.shape)


class MatrixGameRun(nn.Module):
    """One rollout's chunk model over a ``MatrixGameModel``: the 16-channel latent the rollout samples,
    each chunk given its frames of the start-image condition and the actions, and the action caches.

    ``condition`` [B, 20, T_c, h, w]: the mask (4 channels, 1 on latent frame 0) and the start image's VAE
    latent (16), as Matrix-Game 2.0 encodes the image followed by black frames; frames past T_c take its
    last (the black frames' latent, which repeats). ``keyboard`` [B, N, keys], ``mouse`` [B, N, 2] (None:
    a model without one): one row per video frame, N = 1 + 4 (frames - 1) at least. Its caches live with
    it: bind a fresh one per rollout."""

    graph_safe = True

    def __init__(self, model: MatrixGameModel, condition: torch.Tensor, keyboard: torch.Tensor,
                 mouse: torch.Tensor | None, *, frames: int):
        super().__init__()
        cfg = model.actions
        b = condition.shape[0]
        need = 1 + FRAMES_PER_LATENT * (frames - 1)
        if condition.ndim != 5 or condition.shape[1] != CONDITION_CHANNELS:
            raise FastARError(f"the start-image condition must be [B, {CONDITION_CHANNELS}, T, h, w] (mask and "
                              f"latent), got {tuple(condition.shape)}")
        if keyboard.ndim != 3 or keyboard.shape[0] != b or keyboard.shape[2] != cfg.keyboard_dim \
                or keyboard.shape[1] < need:
            raise FastARError(f"keyboard actions must be [B={b}, N >= {need}, {cfg.keyboard_dim}] (a row per video "
                              f"frame of {frames} latent frames), got {tuple(keyboard.shape)}")
        if (mouse is None) != (cfg.mouse_dim == 0):
            raise FastARError("this model " + ("takes mouse actions: give them" if cfg.mouse_dim
                                               else "has no mouse: give none"))
        if mouse is not None and (mouse.ndim != 3 or mouse.shape[0] != b or mouse.shape[2] != cfg.mouse_dim
                                  or mouse.shape[1] < need):
            raise FastARError(f"mouse actions must be [B={b}, N >= {need}, {cfg.mouse_dim}], got {tuple(mouse.shape)}")
        self.model, self.condition, self.keyboard, self.mouse = model, condition, keyboard, mouse
        ph, pw = model.config.patch_size[1:]
        tokens = (condition.shape[3] // ph) * (condition.shape[4] // pw)
        self.window = cfg.local_frames
        self.caches = ActionCaches(cfg, batch=b, tokens=tokens, slots=cfg.local_frames or frames,
                                   device=condition.device, dtype=model.dtype)
        self.fills_cache = cfg.blocks < model.config.num_layers  # the last block's action caches need its forward

    def __getattr__(self, name):  # the chunk-model protocol's geometry is the model's
        if name in ("num_layers", "num_heads", "head_dim", "patch_size", "context_dim", "context_len", "dtype"):
            return getattr(self.model, name)
        return super().__getattr__(name)

    @property
    def latent_channels(self) -> int:
        return self.model.config.out_dim

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, *, frame_offset=0, attention=None,
                fill_cache: bool = False):
        """Flow prediction for a chunk x [B, 16, F, h, w] from latent frame ``frame_offset`` (an int, or a
        0-d tensor in a replayed CUDA graph), under CLIP-vision tokens ``context`` [B, 257, 1280]."""
        f = x.shape[2]
        frames = torch.arange(f, device=x.device)
        frames = frames + (frame_offset.long() if isinstance(frame_offset, torch.Tensor) else frame_offset)
        cond = self.condition.index_select(2, frames.clamp_max(self.condition.shape[2] - 1))
        slots, valid = self.caches.begin(frames, self.window)
        cos, sin = rope_tables(frames)
        step = ActionStep(_windows(self.keyboard, frames), None if self.mouse is None else _windows(self.mouse, frames),
                          cos, sin, slots, valid, self.caches)
        return self.model(torch.cat([x, cond.to(x.dtype)], 1), t, context, frame_offset=frame_offset,
                          attention=attention, fill_cache=fill_cache, action=step)
