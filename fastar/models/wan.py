"""A compact Wan 2.1 text-to-video DiT that runs one chunk of frames at a time.

Parameter names and math follow the Wan 2.1 checkpoints as ComfyUI loads them
(``blocks.N.self_attn.q.weight`` ...), so a Wan 2.1 T2V or causal (Self-Forcing, CausVid,
LongLive) state dict loads unchanged. Two things differ from a full-sequence DiT:
the temporal RoPE index starts at ``frame_offset``, and every attention call goes through
an attention state (``fastar.attention.FastARAttention``), which owns the KV cache.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.adaln import adaln_auto
from ...kernels.fp8_linear import quantize_rows_auto
from ...kernels.qk_norm_rope import qk_norm_rope_auto
from ..errors import FastARError
from .fp8 import Fp8Linear
from .rope import rope_frequencies, sinusoidal_embedding


@dataclass(frozen=True)
class WanConfig:
    dim: int
    ffn_dim: int
    num_heads: int
    num_layers: int
    in_dim: int = 16
    out_dim: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    patch_size: tuple[int, int, int] = (1, 2, 2)
    qk_norm: bool = True
    cross_attn_norm: bool = True
    eps: float = 1e-6
    text_len: int = 512  # umT5 tokens: Wan pads the prompt's features with zeros to this length

    def __post_init__(self):
        if self.dim % self.num_heads:
            raise FastARError(f"WanConfig: dim={self.dim} is not divisible by num_heads={self.num_heads}")
        if self.head_dim % 2 or (self.head_dim // 6) < 1:
            raise FastARError(f"WanConfig: head_dim={self.head_dim} must be even and at least 6 for 3-axis RoPE")
        if self.patch_size[0] != 1:
            raise FastARError("WanConfig: temporal patch size must be 1 for frame-wise autoregression")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "WanConfig":
        """A file's recorded config. Keys a model now takes from its class are dropped: files written before
        carry ``cross_attn``, ``action_layers``, ``action_dim`` and ``image_context``."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names})


WAN_CONFIGS = {
    "1.3B": WanConfig(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30),
    "14B": WanConfig(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40),
    # Test size: every code path of the real model, small enough for fp32 on a CPU.
    "tiny": WanConfig(dim=64, ffn_dim=128, num_heads=2, num_layers=2, text_dim=32, freq_dim=32),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


class WanAttention(nn.Module):
    """q/k/v/o projections with RMS q/k norm; self- or cross-attention by how it is called."""

    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.o = nn.Linear(cfg.dim, cfg.dim)
        self.norm_q = RMSNorm(cfg.dim, cfg.eps) if cfg.qk_norm else nn.Identity()
        self.norm_k = RMSNorm(cfg.dim, cfg.eps) if cfg.qk_norm else nn.Identity()

    def heads(self, x):
        return x.unflatten(-1, (self.num_heads, self.head_dim))

    def _norm_rope(self, norm, x, freqs, out=None):
        weight = norm.weight if isinstance(norm, RMSNorm) else None
        return qk_norm_rope_auto(x, weight, freqs, self.num_heads, norm.eps if weight is not None else 0.0, out=out)

    def _qkv(self, x, freqs, attention, layer):
        """q, k, v [B, L, H, D]; k and v computed straight into the KV cache's rows of the open chunk
        (``FastARAttention.kv_rows``) where their layout allows: no copy per forward into the cache; q
        into the cache's query fold where it keeps one (``FastARAttention.q_rows``): no fold per call."""
        rows = attention.kv_rows(layer)
        k_rows, v_rows = rows if rows is not None and rows[0].dtype == x.dtype else (None, None)
        q_rows = attention.q_rows(layer)
        q_rows = q_rows if q_rows is not None and q_rows.dtype == x.dtype else None
        # fp8 projections share one quantization of x
        fp8 = all(isinstance(p, Fp8Linear) for p in (self.q, self.k, self.v))
        kw = {"rows": quantize_rows_auto(x.reshape(-1, x.shape[-1]))} if fp8 else {}
        q = self._norm_rope(self.norm_q, self.q(x, **kw), freqs, out=q_rows)
        k = self._norm_rope(self.norm_k, self.k(x, **kw), freqs, out=k_rows)
        if v_rows is None or not v_rows.is_contiguous():  # several batches: copied
            return q, k, self.heads(self.v(x, **kw))
        if isinstance(self.v, Fp8Linear):
            self.v(x, out=v_rows.view(-1, x.shape[-1]), **kw)
        elif self.v.bias is not None:
            torch.addmm(self.v.bias, x.reshape(-1, x.shape[-1]), self.v.weight.t(), out=v_rows.view(-1, x.shape[-1]))
        else:
            return q, k, self.heads(self.v(x))
        return q, k, v_rows

    def self_attention(self, x, freqs, attention, layer):
        return self.o(attention.self_attention(layer, *self._qkv(x, freqs, attention, layer)).flatten(2))

    def fill_cache(self, x, freqs, attention, layer):
        """The K/V (and q, which the cache's writes read) into the cache; no attention output."""
        attention.fill_cache(layer, *self._qkv(x, freqs, attention, layer))

    def text_kv(self, context):
        """The cross-attention's K/V [B, L, H, D] of the embedded text ``context``."""
        return self.heads(self.norm_k(self.k(context))), self.heads(self.v(context))

    def cross_attention(self, x, text_kv, attention, layer):
        q = self.heads(self.norm_q(self.q(x)))
        return self.o(attention.cross_attention(layer, q, *text_kv).flatten(2))


class MLPProj(nn.Module):
    """Wan's image-context projection (``img_emb``): CLIP-vision tokens into the model's width."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.proj = nn.Sequential(nn.LayerNorm(in_dim), nn.Linear(in_dim, in_dim), nn.GELU(), nn.Linear(in_dim, out_dim),
                                  nn.LayerNorm(out_dim))

    def forward(self, x):
        return self.proj(x)


class WanAttentionBlock(nn.Module):
    def __init__(self, cfg: WanConfig, action_model: nn.Module | None = None, cross_attn: bool = True):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, cfg.eps, elementwise_affine=False)
        self.self_attn = WanAttention(cfg)
        self.norm3 = nn.LayerNorm(cfg.dim, cfg.eps) if cfg.cross_attn_norm and cross_attn else nn.Identity()
        self.cross_attn = WanAttention(cfg) if cross_attn else None
        self.action_model = action_model  # Matrix-Game 2.0's place: after the cross-attention, before the FFN
        self.norm2 = nn.LayerNorm(cfg.dim, cfg.eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(cfg.dim, cfg.ffn_dim), nn.GELU(approximate="tanh"),
                                 nn.Linear(cfg.ffn_dim, cfg.dim))
        self.modulation = nn.Parameter(torch.zeros(1, 6, cfg.dim))

    def _modulate(self, x, e, residual):
        """The block's modulation [B, T, C] x 6, and x with the previous block's pending FFN update
        added in the same pass as the first norm, h."""
        e = (self.modulation.to(x.dtype).unsqueeze(0) + e).unbind(2)
        y, gate = residual if residual is not None else (None, None)
        x, h = adaln_auto(x, e[1], e[0], y=y, gate=gate, eps=self.norm1.eps)
        return e, x, h.reshape(x.shape[0], -1, x.shape[-1])

    def forward(self, x, e, freqs, text_kv, attention, layer, residual=None, action=None):
        """x [B, F, S, C] tokens grouped by frame; e [B, T, 6, C] per-frame modulation; ``text_kv``
        this block's cross-attention K/V (``WanModel.cross_kv``); ``action`` the action module's
        condition [B, F, action_dim] where the block has one; ``residual``
        the previous block's pending FFN update ``(y, gate)``. Returns ``(x, residual)``: this
        block's FFN update is left pending too, so that each residual update and the norm after
        it are one pass (``adaln_auto``): the next block's first norm, or the head's, adds it."""
        e, x, h = self._modulate(x, e, residual)
        y = self.self_attn.self_attention(h, freqs, attention, layer).view_as(x)
        if isinstance(self.norm3, nn.LayerNorm):
            x, h = adaln_auto(x, self.norm3.weight, self.norm3.bias, y=y, gate=e[2], one_plus=False,
                              eps=self.norm3.eps)
        else:
            x = h = torch.addcmul(x, y, e[2].unsqueeze(2))
        y = None
        if self.cross_attn is not None:
            y = self.cross_attn.cross_attention(h.reshape(x.shape[0], -1, x.shape[-1]), text_kv, attention,
                                                layer).view_as(x)
        if self.action_model is not None:
            x = self.action_model(x if y is None else x + y, action)
            y = None
        x, h = adaln_auto(x, e[4], e[3], y=y, eps=self.norm2.eps)
        return x, (self.feed_forward(h), e[5])

    def fill_cache(self, x, e, freqs, attention, layer, residual=None):
        """Only what the cache needs of this block: its self-attention's K/V."""
        _, _, h = self._modulate(x, e, residual)
        self.self_attn.fill_cache(h, freqs, attention, layer)

    def feed_forward(self, h):
        """The FFN; on CUDA its tanh GELU runs in the first GEMM's epilogue (cuBLASLt). In fp8 it runs
        in the second GEMM's input quantization: the first GEMM's bf16 pre-activation is read once."""
        up, act, down = self.ffn
        if isinstance(up, Fp8Linear) and isinstance(down, Fp8Linear):
            return down(up(h), gelu_input=True)
        if not h.is_cuda or isinstance(up, Fp8Linear) or (torch.is_grad_enabled() and h.requires_grad):
            return down(act(up(h)))
        hidden = torch._addmm_activation(up.bias, h.reshape(-1, h.shape[-1]), up.weight.t(), use_gelu=True)
        return down(hidden.view(*h.shape[:-1], -1))


class Head(nn.Module):
    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.dim, cfg.eps, elementwise_affine=False)
        self.head = nn.Linear(cfg.dim, cfg.out_dim * math.prod(cfg.patch_size))
        self.modulation = nn.Parameter(torch.zeros(1, 2, cfg.dim))

    def forward(self, x, e, residual=None):
        """``residual``: the last block's pending FFN update (``WanAttentionBlock.forward``)."""
        e = (self.modulation.to(x.dtype).unsqueeze(0) + e.unsqueeze(2)).unbind(2)
        y, gate = residual if residual is not None else (None, None)
        return self.head(adaln_auto(x, e[1], e[0], y=y, gate=gate, eps=self.norm.eps)[1])


class WanModel(nn.Module):
    """Wan 2.1 T2V DiT, forwarded one chunk of latent frames at a time."""

    # A forward syncs nothing with the host and takes ``frame_offset`` as a tensor too: the
    # rollout engine may capture a chunk of forwards as one CUDA graph and replay it.
    graph_safe = True
    # The clean pass may stop at the last block's K/V (``forward(fill_cache=True)``).
    fills_cache = True
    # Under an attention state with ``parallel`` (``fastar.parallel``) a forward runs the rank's share
    # of every frame's tokens and gathers the output.
    head_parallel = True
    # What the cross-attention reads: "text" (umT5 features through ``text_embedding``), "image" (CLIP-vision
    # tokens through ``img_emb``: Matrix-Game 2.0), or None: no cross-attention (the pack's world).
    context_input = "text"

    def __init__(self, cfg: WanConfig, action_model: Callable[[int], nn.Module | None] | None = None):
        """``action_model(i)``: block i's action module (None: none), which the models steered by actions
        give (``WorldModel``, ``MatrixGameModel``); plain Wan has none."""
        super().__init__()
        self.config = cfg
        self.patch_embedding = nn.Conv3d(cfg.in_dim, cfg.dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        if self.context_input == "image":
            self.img_emb = MLPProj(cfg.text_dim, cfg.dim)
        elif self.context_input == "text":
            self.text_embedding = nn.Sequential(nn.Linear(cfg.text_dim, cfg.dim), nn.GELU(approximate="tanh"),
                                                nn.Linear(cfg.dim, cfg.dim))
        action_model = action_model or (lambda i: None)
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(cfg.dim, cfg.dim * 6))
        self.blocks = nn.ModuleList(WanAttentionBlock(cfg, action_model(i), self.context_input is not None)
                                    for i in range(cfg.num_layers))
        self.head = Head(cfg)

    # The chunk-model protocol the rollout engine drives (see fastar.chunk_model.ChunkModel).
    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def latent_channels(self) -> int:
        return self.config.in_dim

    @property
    def patch_size(self) -> tuple[int, int, int]:
        return self.config.patch_size

    @property
    def context_dim(self) -> int:
        """The width of the rows of the rollout's context (``forward``'s ``context``)."""
        return self.config.text_dim

    @property
    def context_len(self) -> int | None:
        """The rows a context is padded to (``fastar.rollout.pad_context``); None: as it comes."""
        return self.config.text_len

    @property
    def dtype(self) -> torch.dtype:
        return self.time_embedding[0].weight.dtype

    @torch.no_grad()
    def init_random(self, seed: int = 0, std: float = 0.02) -> "WanModel":
        """Random weights at the real shapes (no Wan weights can be downloaded here)."""
        for i, (name, p) in enumerate(self.named_parameters()):
            g = torch.Generator(device=p.device).manual_seed(seed * 100_003 + i)
            if name.endswith("modulation"):
                p.normal_(0.0, self.config.dim ** -0.5, generator=g)
            elif name.endswith(("norm_q.weight", "norm_k.weight", "norm3.weight")):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=g)
        return self

    def validate(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> None:
        cfg = self.config
        if x.ndim != 5 or x.shape[1] != cfg.in_dim:
            raise FastARError(f"latent chunk must be [B, {cfg.in_dim}, F, H, W], got {tuple(x.shape)}")
        if x.shape[3] % cfg.patch_size[1] or x.shape[4] % cfg.patch_size[2]:
            raise FastARError(f"latent height/width {tuple(x.shape[3:])} must be multiples of the patch size "
                              f"{cfg.patch_size[1:]} (pixel height/width multiples of 16)")
        if context.ndim != 3 or context.shape[0] != x.shape[0] or context.shape[2] != self.context_dim:
            raise FastARError(f"context must be [B={x.shape[0]}, tokens, {self.context_dim}], "
                              f"got {tuple(context.shape)}")
        if t.ndim not in (1, 2) or t.shape[0] != x.shape[0] or (t.ndim == 2 and t.shape[1] not in (1, x.shape[2])):
            raise FastARError(f"timestep must be [B] or [B, F] with B={x.shape[0]}, F={x.shape[2]}, got {tuple(t.shape)}")

    def cross_kv(self, context: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every block's cross-attention K/V for the text ``context`` [B, L, text_dim]: a function of
        the text alone, so a rollout's attention state keeps them (``FastARAttention.of_context``)."""
        embed = self.img_emb if self.context_input == "image" else self.text_embedding
        text = embed(context.to(self.dtype))
        return [block.cross_attn.text_kv(text) for block in self.blocks]

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, *,
                frame_offset: int = 0, attention=None, fill_cache: bool = False, action=None) -> torch.Tensor | None:
        """Flow prediction for a chunk x [B, C, F, H, W] whose first frame is ``frame_offset``.

        t is [B] or per frame [B, F]; context the text features [B, L, text_dim]. ``attention``
        is the state every attention call goes through; None means plain dense attention.
        ``fill_cache``: the clean pass, whose output nobody reads: the forward stops once the
        last block's K/V are in the cache (``attention.fill_cache``) and returns None. ``action``: what
        the blocks' action modules read (``fastar.models.matrix_game``).
        """
        from ..attention import FastARAttention

        self.validate(x, t, context)
        attention = attention if attention is not None else FastARAttention()
        tokens, e, e0, grid = self.embed(x, t)
        text_kv = attention.of_context(context, self.cross_kv)
        freqs = rope_frequencies(self.config.head_dim, grid, frame_offset, device=x.device)
        parallel = getattr(attention, "parallel", None)
        if parallel is not None:  # head parallelism: this rank's part of every frame's tokens
            tokens, freqs = parallel.shard_tokens(tokens, freqs)
        out = self.run_blocks(tokens, e, e0, freqs, attention, fill_cache, text_kv=text_kv, action=action)
        if fill_cache:
            return out
        if parallel is not None:
            out = parallel.gather_tokens(out)
        return self.unpatchify(out, grid)

    def embed(self, x: torch.Tensor, t: torch.Tensor):
        """A chunk's tokens [B, F, S, C] (grouped by frame), time embedding e [B, T, C] and per-frame
        modulation e0 [B, T, 6, C] for latents x [B, C, F, H, W] at timesteps t ([B] or [B, F]), and
        the token grid (f, h, w)."""
        cfg, dtype = self.config, self.dtype
        tokens = self.patch_embedding(x.to(self.patch_embedding.weight.dtype)).to(dtype)
        b, _, f, h, w = tokens.shape
        tokens = tokens.flatten(3).permute(0, 2, 3, 1).contiguous()
        t = t.reshape(b, -1)
        e = self.time_embedding(sinusoidal_embedding(cfg.freq_dim, t.flatten()).to(dtype)).unflatten(0, t.shape)
        return tokens, e, self.time_projection(e).unflatten(2, (6, cfg.dim)), (f, h, w)

    def run_blocks(self, tokens, e, e0, freqs, attention, fill_cache: bool = False, *, text_kv=None, action=None):
        """The blocks (block i with ``text_kv[i]`` where there is text, ``action`` where it has an action
        module), then the head: [B, F, S, pt*ph*pw*C]. ``fill_cache``: stop once the last block's K/V are
        in the cache, and return None."""
        residual, last = None, len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            if fill_cache and i == last:
                return block.fill_cache(tokens, e0, freqs, attention, i, residual)
            tokens, residual = block(tokens, e0, freqs, None if text_kv is None else text_kv[i], attention, i,
                                     residual, action=action)
        return self.head(tokens, e, residual)

    def unpatchify(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        pt, ph, pw = self.config.patch_size
        c = self.config.out_dim
        b = x.shape[0]
        u = x.reshape(b, *grid, pt, ph, pw, c)
        u = torch.einsum("bfhwpqrc->bcfphqwr", u)
        return u.reshape(b, c, grid[0] * pt, grid[1] * ph, grid[2] * pw)
