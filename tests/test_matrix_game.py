"""Matrix-Game 2.0: its four files' key layouts load (variant, keys, mouse, action blocks read off the keys),
the action module equals the paper's equations written out in plain torch (windows padded with the first
action, the mouse's temporal attention per position, the keyboard tokens every video token attends, the
rolling window of latent frames), and a rollout steered by actions runs causally under FAST-AR's caches."""
import math
import os
import sys

import pytest
import torch
from safetensors.torch import save_file

from comfyui_fastar.fastar import CacheConfig, FastARError, FlowMatchSchedule, Rollout, TempCacheConfig
from comfyui_fastar.fastar.models import MatrixGameModel, convert_checkpoint, load_wan
from comfyui_fastar.fastar.models.matrix_game import (HEAD_DIM, ActionCaches, ActionConfig, ActionStep,
                                                      MatrixGameActionModule,
                                                      _windows, detect, rope_tables)
from comfyui_fastar.testing.checkpoints import MATRIX_GAME_FILES, converted, matrix_game_weights


def _file(tmp_path, variant, **kw):
    path = tmp_path / f"{variant}.safetensors"
    save_file(matrix_game_weights(variant, **kw), str(path))
    return path


@pytest.mark.parametrize("variant", sorted(MATRIX_GAME_FILES))
def test_each_published_files_layout_loads_as_its_variant(tmp_path, variant):
    """Each file as released (``model.`` before every key): load_wan builds the Matrix-Game model whose
    parameters are exactly the file's, with its keys, mouse and action blocks read off them."""
    keys, mouse, _ = MATRIX_GAME_FILES[variant]
    path = _file(tmp_path, variant)
    model = load_wan(path, num_heads=2)
    assert isinstance(model, MatrixGameModel)
    want = {k[len("model."):] for k in matrix_game_weights(variant)}
    assert set(model.state_dict()) == want
    a = model.actions
    assert (a.keyboard_dim, a.mouse_dim > 0, a.blocks) == (keys, mouse, 2 if variant == "foundation" else 1)
    assert model.config.in_dim == 36 and model.context_input == "image" and model.config.text_dim == 48
    assert detect({k[6:]: v for k, v in matrix_game_weights(variant).items()}, 2)[2].name == variant


def test_convert_records_the_variant_and_its_sampling(tmp_path):
    """fastar convert --preset matrix-game-2: the prefix stripped, the variant, its keys, window and the
    sampling it was trained for in the metadata; the file loads without being told its head count."""
    src, dst = _file(tmp_path, "templerun"), tmp_path / "out.safetensors"
    done = convert_checkpoint(src, dst, preset="matrix-game-2", num_heads=2)
    state, metadata = converted(dst)
    assert not any(k.startswith("model.") for k in state)
    assert '"variant": "templerun"' in metadata["fastar.matrix_game"]
    assert done.sampling.timesteps == (1000.0, 750.0, 500.0, 250.0) and done.sampling.frames_per_block == 3
    assert load_wan(dst).actions.local_frames == 6
    plain = tmp_path / "plain.safetensors"
    save_file({"patch_embedding.weight": torch.zeros(64, 16, 1, 2, 2), "blocks.0.self_attn.q.weight": torch.zeros(1)},
              str(plain))
    with pytest.raises(FastARError, match="not a Matrix-Game 2.0 model"):
        convert_checkpoint(plain, tmp_path / "x.safetensors", preset="matrix-game-2")


# --------------------------------------------------------------------------- the action module


def _rms(x):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _rope(x, frame):
    """x [..., HEAD_DIM] at latent frame ``frame``: channels (2j, 2j+1), j < 4, turned by frame / 256^(j/4)."""
    out = x.clone()
    for j in range(4):
        angle = frame * 256.0 ** (-2 * j / 8)
        a, b = x[..., 2 * j], x[..., 2 * j + 1]
        out[..., 2 * j], out[..., 2 * j + 1] = a * math.cos(angle) - b * math.sin(angle), b * math.cos(angle) + a * math.sin(angle)
    return out


def _window(rows, i):
    """Latent frame i's 12 rows [B, 12, width]: [4i - 12, 4i), before the first taken as the first."""
    return torch.stack([rows[:, max(0, 4 * i - 12 + m)] for m in range(12)], 1)


def _reference(module, hidden, keyboard, mouse, chunk, local):
    """The action module's output for every latent frame, from the equations: hidden [B, T, S, C]."""
    b, t, s, c = hidden.shape
    heads = module.cfg.heads

    def split(x):
        return x.unflatten(-1, (heads, HEAD_DIM))

    out = torch.empty_like(hidden)
    for i in range(t):
        end = (i // chunk + 1) * chunk
        keys = [j for j in range(max(0, end - local), end)]
        x = hidden[:, i]
        if mouse is not None:
            def mqkv(j):
                w = _window(mouse, j).flatten(1)[:, None].expand(b, s, -1)
                return module.t_qkv(module.mouse_mlp(torch.cat([hidden[:, j], w], -1))).unflatten(-1, (3, heads, HEAD_DIM))
            q = _rope(_rms(mqkv(i)[..., 0, :, :]), i)                             # [B, S, heads, 64]
            ks = torch.stack([_rope(_rms(mqkv(j)[..., 1, :, :]), j) for j in keys], 2)  # [B, S, J, heads, 64]
            vs = torch.stack([mqkv(j)[..., 2, :, :] for j in keys], 2)
            w = torch.softmax(torch.einsum("bshd,bsjhd->bshj", q, ks) / 8.0, -1)
            x = x + module.proj_mouse(torch.einsum("bshj,bsjhd->bshd", w, vs).flatten(-2))
        def kkv(j):
            kv = module.keyboard_attn_kv(module.keyboard_embed(_window(keyboard, j)).flatten(1))
            return kv.unflatten(-1, (2, heads, HEAD_DIM))                         # [B, 2, heads, 64]
        q = _rope(_rms(split(module.mouse_attn_q(x))), i)
        ks = torch.stack([_rope(_rms(kkv(j)[:, 0]), j) for j in keys], 1)       # [B, J, heads, 64]
        vs = torch.stack([kkv(j)[:, 1] for j in keys], 1)
        w = torch.softmax(torch.einsum("bshd,bjhd->bshj", q, ks) / 8.0, -1)
        out[:, i] = x + module.proj_keyboard(torch.einsum("bshj,bjhd->bshd", w, vs).flatten(-2))
    return out


@pytest.mark.parametrize("mouse,local", [(True, 6), (True, 4), (False, 6), (True, None)],
                         ids=["universal", "gta-window", "templerun", "foundation"])
@torch.no_grad()
def test_the_action_module_is_the_papers_equations(mouse, local):
    """Chunk by chunk through its rolling caches (each chunk first on noisy hidden states, as a denoising
    step, then on the clean ones, as the clean pass): the outputs are the equations' over the clean states."""
    torch.manual_seed(0)
    cfg = ActionConfig(keyboard_dim=4, mouse_dim=2 if mouse else 0, blocks=1, hidden=128, keyboard_hidden=16,
                       local_frames=local)
    module = MatrixGameActionModule(32, cfg, 0)
    for p in module.parameters():
        p.normal_(0, 0.2)
    b, t, s, chunk = 1, 9, 5, 3
    hidden = torch.randn(b, t, s, 32)
    rows = 1 + 4 * (t - 1)
    keyboard = (torch.rand(b, rows, 4) < 0.4).float()
    mouse_rows = 0.1 * torch.randn(b, rows, 2) if mouse else None
    caches = ActionCaches(cfg, batch=b, tokens=s, slots=local or t, device="cpu", dtype=torch.float32)
    got = []
    for c in range(0, t, chunk):
        frames = torch.arange(c, c + chunk)
        for h in (torch.randn(b, chunk, s, 32), hidden[:, c:c + chunk]):  # a denoising step, then the clean pass
            slots, valid = caches.begin(frames, local)
            cos, sin = rope_tables(frames)
            step = ActionStep(_windows(keyboard, frames), None if mouse_rows is None else _windows(mouse_rows, frames),
                              cos, sin, slots, valid, caches)
            out = module(h, step)
        got.append(out)
    want = _reference(module, hidden, keyboard, mouse_rows, chunk, local or t)
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=1e-4, atol=1e-5)


def test_windows_pad_with_the_first_action():
    rows = torch.arange(9.0).view(1, 9, 1)
    w = _windows(rows, torch.tensor([0, 1, 2]))[0, :, :, 0]
    assert w[0].tolist() == [0.0] * 12
    assert w[1].tolist() == [0.0] * 9 + [1.0, 2.0, 3.0]
    assert w[2].tolist() == [0.0] * 5 + [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]


# --------------------------------------------------------------------------- a rollout steered by actions


def _tiny(variant="universal", seed=1):
    state = {k[6:]: v for k, v in matrix_game_weights(variant, seed=seed).items()}
    model = MatrixGameModel(*detect(state, 2)[:2])
    model.load_state_dict(state)
    return model.eval()


@pytest.mark.parametrize("cache", [CacheConfig("window", sink_frames=0, window_frames=3),
                                   TempCacheConfig(max_cache_frames=6, sink_frames=0, merge_threshold=0.9)],
                         ids=["matrix-game-window", "tempcache"])
@torch.no_grad()
def test_a_rollout_is_steered_causally_by_its_actions(cache):
    """A rollout of 9 latent frames at 32x64: finite; actions changed from the second chunk on leave the
    first chunk as it was and change what follows."""
    model = _tiny()
    frames, b = 9, 1
    g = torch.Generator().manual_seed(3)
    condition = torch.randn(b, 20, 1, 4, 8, generator=g)
    clip = torch.randn(b, 257, 48, generator=g)
    rows = 1 + 4 * (frames - 1)
    keyboard = torch.zeros(b, rows, 4)
    mouse = torch.zeros(b, rows, 2)

    def run(keyboard):
        return model.rollout(clip, condition, keyboard, mouse, frames=frames, height=32, width=64,
                             schedule=FlowMatchSchedule(), cache=cache, seed=5).run()

    still = run(keyboard)
    turned = keyboard.clone()
    turned[:, 13:, 0] = 1.0  # W from video frame 13 on, which latent frame 4 (the second chunk) reads first
    moved = run(turned)
    assert still.isfinite().all() and still.shape == (1, 16, frames, 4, 8)
    assert torch.equal(still[:, :, :3], moved[:, :, :3])
    assert (still[:, :, 3:] - moved[:, :, 3:]).abs().max() > 1e-4


@pytest.mark.cuda
@torch.no_grad()
def test_chunks_replayed_from_cuda_graphs_equal_the_eager_rollout():
    """The action caches are read by frame index on the device: a rollout whose repeating chunks replay
    from a CUDA graph gives the eager rollout's video."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = _tiny().cuda()
    frames = 18
    g = torch.Generator(device="cuda").manual_seed(3)
    condition = torch.randn(1, 20, 1, 4, 8, device="cuda", generator=g)
    clip = torch.randn(1, 257, 48, device="cuda", generator=g)
    rows = 1 + 4 * (frames - 1)
    keyboard = (torch.rand(1, rows, 4, device="cuda", generator=g) < 0.3).float()
    mouse = 0.1 * torch.randn(1, rows, 2, device="cuda", generator=g)

    def run(graphs):
        r = Rollout(model.bind(condition, keyboard, mouse, frames=frames), clip, frames=frames, height=32, width=64,
                    chunk_frames=3, cache=CacheConfig("window", sink_frames=0, window_frames=3), seed=5,
                    cuda_graphs=graphs)
        return r.run(), r.graph_replays

    (eager, _), (graphed, replays) = run(False), run(True)
    assert replays > 0
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)


def test_action_text_reads_each_variants_keys():
    """One action text for every variant: the universal model's W / S / A / D and looks, GTA's W / S as
    forward / back and A / D as steering (yaw), Temple Run's one-hot keys with "nomove" for idle; a key
    the variant lacks is refused by name."""
    from comfyui_fastar.fastar.models.matrix_game import VARIANTS
    from comfyui_fastar.fastar.actions import parse_actions

    universal = parse_actions("W+D*1f, look_left*1f", VARIANTS["universal"].actions, 12)
    assert universal.tolist() == [[1, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, pytest.approx(-0.1)]]
    gta = parse_actions("W*1f, S+D*1f, idle*1f", VARIANTS["gta"].actions, 12)
    assert gta.tolist() == [[1, 0, 0, 0], [0, 1, 0, pytest.approx(0.1)], [0, 0, 0, 0]]
    run = parse_actions("jump*1f, idle*2f", VARIANTS["templerun"].actions, 12)
    assert run.tolist() == [[0, 1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]]
    assert parse_actions("idle", VARIANTS["templerun"].actions, 12).shape == (12, 7)  # a chunk by default
    with pytest.raises(FastARError, match="unknown action 'look_up'; this world knows nomove, jump"):
        parse_actions("look_up", VARIANTS["templerun"].actions, 12)


def test_each_variant_plays_under_its_own_window():
    """The play benchmark's window cache per variant: its local frames, the open chunk among them."""
    from comfyui_fastar.fastar.models.matrix_game import VARIANTS

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from common import window_cache

    assert window_cache(VARIANTS["gta"]).window_frames == 1 and window_cache(VARIANTS["universal"]).window_frames == 3
    assert window_cache(VARIANTS["foundation"]).mode == "unbounded"
