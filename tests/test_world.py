"""The pack's world: actions and trajectories do what they claim, the world model's training forward is
the rollout's, and the committed model loads and has learned to remember."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from comfyui_fastar.fastar import photo_world
from comfyui_fastar.fastar.actions import ActionSpec, actions_text, integrate, parse_actions
from comfyui_fastar.fastar.config import CacheConfig
from comfyui_fastar.fastar.errors import FastARError
from comfyui_fastar.fastar.models import checkpoint_sampling, load_wan
from comfyui_fastar.fastar.models.world import WorldModel, WorldSpec, save_world, world_config
from comfyui_fastar.fastar.rollout import Rollout

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)
from common import trajectories  # noqa: E402
SPEC = ActionSpec()
# the scripts' smoke runs on the torch twins: Triton's interpreter would only make them slow
TWINS = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def frames(*held, n=1, mouse=(0.0, 0.0)):
    """n video frames of actions with ``held`` keys down and the mouse at ``mouse``."""
    a = torch.zeros(n, SPEC.width)
    for k in held:
        a[:, SPEC.keys.index(k)] = 1
    a[:, len(SPEC.keys):] = torch.tensor(mouse)
    return a


def test_action_encoding_is_matrix_games_layout():
    # multi-hot keys in the spec's order, then [pitch, yaw]: what Matrix-Game 2.0's keyboard and mouse
    # conditions hold per video frame
    assert SPEC.width == 8 and SPEC.keys == ("W", "S", "A", "D", "zoom_in", "zoom_out")
    a = parse_actions("W+D*2f, look_left*1f", SPEC, 12)
    assert a.tolist() == [[1, 0, 0, 1, 0, 0, 0, 0]] * 2 + [[0, 0, 0, 0, 0, 0, 0, np.float32(-0.1)]]


def test_integrate_moves_the_camera_as_documented():
    start = torch.tensor([100.0, 80.0, 0.0])
    poses = integrate(torch.cat([frames("D", n=3), frames("W", n=2), frames(mouse=(0.1, 0.05))]), SPEC, start)
    assert poses[2].tolist() == pytest.approx([100 + 3 * SPEC.pan, 80, 0])           # D pans right
    assert poses[4].tolist() == pytest.approx([112, 80 - 2 * SPEC.pan, 0])         # W pans up
    assert poses[5].tolist() == pytest.approx([112 + 0.05 * SPEC.mouse_pan, 72 - 0.1 * SPEC.mouse_pan, 0])
    zoomed = integrate(torch.cat([frames("zoom_out", n=2), frames("D")]), SPEC)
    s = SPEC.zoom ** 2
    assert zoomed[-1].tolist() == pytest.approx([SPEC.pan * s, 0, np.log(s)], rel=1e-5)  # a pan is the view's share
    assert integrate(frames("zoom_in", "zoom_out", "W", "S"), SPEC)[0].tolist() == [0, 0, 0]


def test_render_is_the_photographs_crop():
    photo = torch.rand(3, 160, 200)
    frame = photo_world.render(photo, torch.tensor([[100.0, 80.0, 0.0]]), 64)[0]
    assert torch.allclose(frame, photo[:, 48:112, 68:132] * 2 - 1, atol=1e-4)
    moved = photo_world.render(photo, torch.tensor([[104.0, 80.0, 0.0]]), 64)[0]
    assert torch.allclose(moved[:, :, :-4], frame[:, :, 4:], atol=1e-4)             # 4 px right: the view slid
    outside = photo_world.render(photo, torch.tensor([[-100.0, 80.0, 0.0]]), 64)[0]
    assert (outside == -1).all()                                                     # black off the photo


@pytest.mark.parametrize("n", [48, 96, 192, 384])
def test_revisit_returns_to_a_place_by_another_route(n):
    spec = WorldSpec()
    r = photo_world.revisit_actions(spec.actions, n, (384, 614), spec.view, np.random.default_rng(n))
    poses = integrate(torch.from_numpy(r.actions), spec.actions)
    assert len(r.actions) == r.lead_in + n + r.frames_after and len(r.actions) % 12 == 0
    assert len(r.revisit) == r.frames_after
    for f in r.revisit:  # the revisited frames stand where the camera stood n frames before ...
        assert poses[f].tolist() == pytest.approx(poses[f - n].tolist(), abs=1e-3)
    # ... by a loop that took it out of view of the place and back along another row
    away = (poses[r.lead_in:r.lead_in + n] - poses[r.lead_in - 1]).abs()
    assert away[:, 0].max() > spec.view and away[n // 2, 1] > 0
    assert photo_world.place(poses, (384, 614), spec.view, np.random.default_rng(0)) is not None  # it fits the photo


def test_loop_and_training_trajectories():
    rng = np.random.default_rng(0)
    a = trajectories.loop(SPEC, 50, rng)
    assert len(a) == 50 and integrate(torch.from_numpy(a), SPEC)[-1].tolist() == pytest.approx([0, 0, 0])
    t = trajectories.training_actions(SPEC, 192, np.random.default_rng(1))
    assert t.shape == (192, SPEC.width) and t.dtype == np.float32
    logs = integrate(torch.from_numpy(trajectories.random_walk(SPEC, 400, np.random.default_rng(2))), SPEC)[:, 2]
    assert np.log(0.7) - 1e-5 <= logs.min() and logs.max() <= np.log(1.4) + 1e-5      # zoom kept in range
    assert np.array_equal(t, trajectories.training_actions(SPEC, 192, np.random.default_rng(1)))  # from the seed alone


def test_parse_actions_counts_units_and_json():
    a = parse_actions("D*2, idle, zoom_in*3f", SPEC, 12)
    assert len(a) == 2 * 12 + 12 + 3
    assert (a[:24, SPEC.keys.index("D")] == 1).all() and not a[24:36].any() and (a[36:, 4] == 1).all()
    assert np.array_equal(parse_actions('[["D", 2], ["idle", 1]]', SPEC, 12), a[:36])
    assert np.array_equal(parse_actions("d * 2 , IDLE", SPEC, 12), a[:36])  # case and spaces


def test_parse_actions_reads_seconds_and_exact_looks():
    a = parse_actions("W*1.5s, look(0.05, -0.1)+A*2f", SPEC, 12, fps=8.0)
    assert len(a) == 12 + 2 and (a[:12, SPEC.keys.index("W")] == 1).all()
    assert (a[12:, SPEC.keys.index("A")] == 1).all() and np.allclose(a[12:, -2:], [0.05, -0.1])
    assert len(parse_actions("W*1.5s", SPEC, 12)) == 24  # 16 fps by default
    with pytest.raises(FastARError, match=r"whole number \(seconds take s: \*1\.5s\)"):
        parse_actions("W*1.5f", SPEC, 12)


def test_actions_text_reads_back_to_the_same_rows():
    """The action log a live session returns: its text replays the exact rows, odd mouse moves included."""
    rng = np.random.default_rng(3)
    rows = parse_actions("W*5f, W+D*7f, look_left*3f, idle*2f", SPEC, 12)
    rows[10:13, -2:] = rng.uniform(-0.12, 0.12, size=(3, 2)).astype(np.float32)  # a mouse no named look matches
    rows[13] = parse_actions("look(0.03,-0.07)", SPEC, 1)[0]
    text = actions_text(rows, SPEC)
    assert "look(" in text and text.startswith("W*5f, W+D*5f")
    assert "look(0.03,-0.07)*1f" in text  # the shortest decimals that read back, not float32's noise
    assert np.array_equal(parse_actions(text, SPEC, 12), rows)


@pytest.mark.parametrize("text, says", [("W, jump*2", "'jump'"), ("W*x", "'W*x'"), ("", "no action"),
                                        ("[[1, 2", "JSON"), ("W*0", "holds no frame")])
def test_parse_actions_names_the_bad_token(text, says):
    with pytest.raises(FastARError, match=says.replace("*", r"\*").replace("[", r"\[")):
        parse_actions(text, SPEC, 12)
    with pytest.raises(FastARError, match="knows W, S, A, D, zoom_in, zoom_out, idle$"):
        parse_actions("look_up", ActionSpec(mouse=False), 12)


def test_world_latent_round_trips():
    spec = WorldSpec()
    video = torch.rand(1, 3, 8, 64, 64) * 2 - 1
    latent = spec.encode(video)
    assert latent.shape == (1, spec.channels, 2, 16, 16)
    assert torch.equal(spec.decode(latent), video)
    assert spec.context(torch.zeros(1, 8, 8)).shape == (1, 2, 4 * 8)
    with pytest.raises(FastARError, match="multiple of 4"):
        spec.encode(video[:, :, :7])
    assert WorldSpec.from_json(spec.to_json()) == spec


def tiny_world(seed=0, placement="world"):
    spec = WorldSpec(placement=placement)
    cfg = world_config(spec, dim=32, ffn_dim=64, num_heads=2, num_layers=2, action_layers=1)
    return WorldModel(cfg, spec).init_random(seed).eval()


def test_the_screen_placed_twin_places_tokens_on_the_screen_and_the_world_in_the_world():
    """The twin's RoPE is Wan's (frame, row, column) grid whatever the camera does; the pack's world gives
    a token the RoPE of its place on the photograph: the camera panned one token right, the token one column
    to the left holds the RoPE the token beside it had."""
    from comfyui_fastar.fastar.models.rope import rope_frequencies

    screen, world = tiny_world(placement="screen"), tiny_world()
    frames = torch.arange(3, dtype=torch.float64) + 5
    still = torch.zeros(3, 3)
    panned = torch.tensor([[4.0, 0.0, 0.0]] * 3)  # one token: 4 video pixels
    grid = rope_frequencies(screen.config.head_dim, (3, 16, 16), 5)
    assert torch.equal(screen.world_rope(still, frames, (16, 16)), grid)
    assert torch.equal(screen.world_rope(panned, frames, (16, 16)), grid)
    before = world.world_rope(still, frames, (16, 16)).view(3, 16, 16, -1, 2)
    after = world.world_rope(panned, frames, (16, 16)).view(3, 16, 16, -1, 2)
    assert torch.allclose(after[:, :, :-1], before[:, :, 1:], atol=1e-6)
    assert not torch.allclose(after, before)
    spec = WorldSpec(placement="screen")
    assert WorldSpec.from_json(spec.to_json()) == spec
    old = json.loads(WorldSpec().to_json())
    del old["placement"]  # a file from before the twin
    assert WorldSpec.from_json(json.dumps(old)).placement == "world"
    with pytest.raises(FastARError, match="world or screen, not 'camera'"):
        WorldSpec(placement="camera")


@pytest.mark.parametrize("placement", ["world", "screen"])
def test_teacher_forcing_is_the_rollouts_forward(placement):
    """Training's one-sequence forward (clean frames, then noisy ones, under the teacher-forcing mask)
    gives what the rollout computes chunk by chunk over a dense cache filled by clean passes."""
    sys.path.insert(0, BENCH)
    import world_train

    model = tiny_world(placement=placement)
    spec = model.spec
    t, b = 9, 2
    actions = torch.from_numpy(np.stack([trajectories.training_actions(spec.actions, 4 * t, np.random.default_rng(i))
                                         for i in range(b)]))
    g = torch.Generator().manual_seed(0)
    x0, xt = torch.randn(b, spec.channels, t, 16, 16, generator=g), torch.randn(b, spec.channels, t, 16, 16, generator=g)
    steps = torch.tensor([[700.0] * 3 + [300.0] * 3 + [900.0] * 3] * b)
    attention = world_train.TeacherForcing(world_train.teacher_forcing_mask(b, t, 256), b * 2 * t * 256,
                                           torch.device("cpu"))
    with torch.no_grad():
        trained = world_train.noisy_flow(model, spec, x0, xt, steps, actions, attention)
        for i in range(b):
            context = spec.context(actions[i:i + 1])
            ro = Rollout(model, context, frames=t, height=64, width=64, cache=CacheConfig())
            for c in range(t // 3):
                ro.cache.begin_chunk(3 * c, 3)
                rows = slice(3 * c, 3 * c + 3)
                flow = model(xt[i:i + 1, :, rows], steps[i, 3 * c:3 * c + 1], context, frame_offset=3 * c,
                             attention=ro.attention)
                assert torch.allclose(flow, trained[i:i + 1, :, rows], atol=1e-4), (i, c)
                ro.attention.begin_clean_pass()
                model(x0[i:i + 1, :, rows], torch.zeros(1), context, frame_offset=3 * c, attention=ro.attention)
                ro.cache.commit()


def test_world_model_save_load_and_errors(tmp_path):
    from comfyui_fastar.fastar.models.checkpoints import Sampling

    model = tiny_world()
    path = tmp_path / "w.safetensors"
    save_world(model, path, Sampling(3, (1000.0, 666.0, 333.0), 5.0, "w"), dtype=torch.float32)
    loaded = load_wan(path)
    assert isinstance(loaded, WorldModel) and loaded.spec == model.spec
    assert checkpoint_sampling(path).timesteps == (1000.0, 666.0, 333.0)
    for a, b in zip(loaded.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    context = WorldSpec().context(torch.zeros(1, 12, 8))
    with pytest.raises(FastARError, match="the chunk at frame 3 needs 6"):
        loaded(torch.zeros(1, 192, 3, 16, 16), torch.zeros(1), context, frame_offset=3)
    with pytest.raises(FastARError, match="batch 1"):
        loaded(torch.zeros(2, 192, 3, 16, 16), torch.zeros(2), context.expand(2, -1, -1))


def revisit_flight(spec, n):
    """An out-and-back of n frames over the held-out demo photograph, observed up to the loop's first leg."""
    photo = photo_world.load_photo(photo_world.DEMO_PHOTO)
    r = photo_world.revisit_actions(spec.actions, n, tuple(photo.shape[1:]), spec.view, np.random.default_rng(0))
    return photo_world.flight(photo, r.actions, spec.view, r.lead_in + 12, np.random.default_rng(1), r.revisit)


def test_committed_world_model_loads_and_remembers():
    """The committed weights load through the pack's loader and sample chunks on the CPU that match the
    ground truth where the camera comes back, with the cache, far better than without history."""
    model = load_wan(photo_world.WEIGHTS, dtype=torch.float32)
    assert isinstance(model, WorldModel) and checkpoint_sampling(photo_world.WEIGHTS).frames_per_block == 3
    meta = json.loads(__import__("safetensors").safe_open(photo_world.WEIGHTS, "pt").metadata()["fastar.training"])
    assert meta["runs"] and meta["step"] > 0
    from world_eval import OwnChunk
    from world_eval import fly as fly_with

    f = revisit_flight(model.spec, 48)
    with torch.no_grad():
        every = CacheConfig()  # every frame kept
        video, alone = photo_world.fly(model, f, cache=every), fly_with(model, f, (every, None, OwnChunk))
    revisit = list(f.revisit)

    def psnr(video):
        return (10 * torch.log10(4 / (video[:, :, revisit] - f.truth[:, :, revisit]).pow(2).mean())).item()

    assert video.shape == f.truth.shape and torch.isfinite(video).all()
    assert torch.equal(video[:, :, :f.observed], f.truth[:, :, :f.observed])  # the observed past is the truth
    assert psnr(video) > 20 and psnr(video) > psnr(alone) + 3


@pytest.mark.slow
def test_world_train_smoke_resumes_and_exports(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, os.path.join(BENCH, "world_train.py"), "--smoke", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=600, env=TWINS)
    first = run("--out", str(tmp_path / "a"), "--steps", "4", "--latent-frames", "6", "--minutes", "5",
                "--placement", "screen")
    assert first.returncode == 0, first.stderr[-2000:]
    second = run("--out", str(tmp_path / "b"), "--resume", str(tmp_path / "a"), "--minutes", "5",
                 "--export", str(tmp_path / "w.safetensors"))
    assert second.returncode == 0, second.stderr[-2000:]
    state = json.loads((tmp_path / "a" / "world_train.json").read_text())
    assert state["step"] == 4 and len(state["runs"]) == 1 and (tmp_path / "a" / "world_train_loss.png").exists()
    assert state["command"].startswith("python bench/world_train.py")
    model = load_wan(tmp_path / "w.safetensors")
    assert isinstance(model, WorldModel) and model.spec.placement == "screen"  # the resumed run kept it


@pytest.mark.slow
def test_world_eval_smoke(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "world_eval.py"), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, env=TWINS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "world_eval_smoke.json").read_text())
    rows = {r["setting"]: r for r in result["quality"]}
    assert rows["dense"]["psnr_truth"] > rows["own chunk"]["psnr_truth"] + 3  # the trained model reads its history
    assert 0 < rows["tempcache 15 @ 0.95 + AnnSA"]["annsa_density"] <= 1
    assert set(result["timing"]) == set(rows) - {"own chunk"}
    assert all(0 < m["revisit"] < 1 for m in result["history_mass"])
    assert (tmp_path / "world_eval_smoke.png").stat().st_size > 0


def test_files_written_before_the_models_owned_their_inputs_still_load(tmp_path):
    """Configs recorded with ``cross_attn``, ``action_layers``, ``action_dim`` and ``image_context`` (every
    converted file and world before): those keys are the class's now, and the files load as before."""
    from safetensors.torch import load_file, save_file

    from comfyui_fastar.fastar.models import build_model
    from comfyui_fastar.fastar.models.checkpoints import CONFIG_METADATA_KEY, Sampling
    from comfyui_fastar.fastar.models.world import WORLD_METADATA_KEY

    world = tiny_world()
    save_world(world, tmp_path / "new.safetensors", Sampling(3, (1000.0,), 5.0, "w"), dtype=torch.float32)
    legacy = {**world.config.to_dict(), "cross_attn": False, "action_dim": world.spec.condition_dim,
              "image_context": False}
    save_file(load_file(tmp_path / "new.safetensors"), tmp_path / "old_world.safetensors",
              metadata={CONFIG_METADATA_KEY: json.dumps(legacy), WORLD_METADATA_KEY: world.spec.to_json()})
    loaded = load_wan(tmp_path / "old_world.safetensors")
    assert isinstance(loaded, WorldModel) and loaded.config == world.config
    wan = build_model("tiny")
    legacy = {**wan.config.to_dict(), "cross_attn": True, "action_layers": 0, "action_dim": 0, "image_context": False}
    save_file({k: v.contiguous() for k, v in wan.state_dict().items()}, tmp_path / "old_wan.safetensors",
              metadata={CONFIG_METADATA_KEY: json.dumps(legacy)})
    loaded = load_wan(tmp_path / "old_wan.safetensors")
    assert type(loaded).__name__ == "WanModel" and loaded.config == wan.config
