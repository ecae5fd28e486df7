"""Train the pack's world model (``fastar.models.world``) on camera walks over real photographs.

Data: the training photographs in ``assets/worlds/train`` (``bench/world_photos.py`` makes them; the
held-out ones never enter), a random one (randomly mirrored) per trajectory; trajectories of random walks
and rectangle loops (``trajectories.training_actions``), so the camera often comes back to what it saw
many chunks earlier; ground truth rendered on the device. Reproducible from ``--seed``: step s draws its
trajectories and noise from (seed, s) alone, so a resumed run sees what an unbroken one would.

Objective: flow matching with teacher forcing over clean history, the way the rollout's clean pass fills
the cache. Each trajectory runs as its clean latent frames and a noisy copy in one sequence: a clean
chunk attends the clean chunks up to itself (the clean pass), a noisy chunk the clean chunks before it
and itself (a denoising step over the cache). Noise per chunk: half the time one of the sampler's own
steps, else uniform.

Resumable: every ``--save-every`` steps and at the end (``--minutes`` of training in this run) the
state goes to ``--out`` in files under 16 MB: fp32 weights, Adam's second moment in bf16 (its first, a
memory of ~10 steps, restarts at zero on resume), ``world_train.json`` (step, the planned steps, the
loss curve, minutes and device of every run) and the loss curve's plot. ``--resume DIR`` continues from
such a folder. The learning rate follows one cosine over the run's planned steps: ``--steps``, or where
that is 0, as many as ``--total-minutes`` of training hold at the first run's measured pace.
``--export PATH`` writes the model as it is committed and loaded (bf16, with its config, world,
sampling and training record in the metadata).

    python bench/world_train.py --out OUT --minutes 9 --total-minutes 15          # on the GPU, then
    python bench/world_train.py --out OUT2 --resume OUT --minutes 9
    python bench/world_train.py --resume OUT2 --minutes 0 --device cpu --export assets/world/world.safetensors
    python bench/world_train.py --out TWIN --placement screen ...   # the screen-placed twin, trained alike
"""
from __future__ import annotations

import glob
import importlib
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, device_name, fastar, parser, provenance  # noqa: E402
from common import trajectories  # noqa: E402
importlib.import_module(f"{fastar.__name__}.photo_world")  # fastar.photo_world: the package leaves it out

PHOTOS = os.path.join(ROOT, "assets", "worlds")
SAMPLING = fastar.models.world.WORLD_SAMPLING
SAMPLER, SHIFT, CHUNK = SAMPLING.timesteps, SAMPLING.shift, SAMPLING.frames_per_block


@torch.no_grad()
def init_weights(model, seed: int = 0):
    """Weights to train from: Wan's random init, with every residual branch's last layer and the
    modulations at zero, so the untrained model starts as the identity on its input."""
    model.init_random(seed)
    for block in model.blocks:
        block.modulation.zero_()
        if block.action_model is not None:
            block.action_model.mlp[2].weight.zero_()
        block.ffn[2].weight.zero_()
        block.self_attn.o.weight.zero_()
    model.head.modulation.zero_()
    return model


def photos(split: str, device) -> list[torch.Tensor]:
    paths = sorted(glob.glob(os.path.join(PHOTOS, split, "*.jpg")))
    if not paths:
        raise SystemExit(f"no photographs in {PHOTOS}/{split}: run bench/world_photos.py first")
    return [fastar.photo_world.load_photo(p, device) for p in paths]


def batch(spec, worlds, step: int, seed: int, sequences: int, latent_frames: int, device):
    """(frames [B, 3, N, view, view] in [-1, 1], actions [B, N, width]) for training step ``step``."""
    rng = np.random.default_rng([seed, step])
    n = latent_frames * spec.frames_per_latent
    frames, actions = [], []
    while len(frames) < sequences:
        photo = worlds[rng.integers(len(worlds))]
        if rng.random() < 0.5:  # more worlds from the same photographs: mirrored, flipped, colours swapped
            photo = photo.flip(-1)
        if rng.random() < 0.25:
            photo = photo.flip(-2)
        if rng.random() < 0.3:
            photo = photo[torch.from_numpy(rng.permutation(3))]
        a = trajectories.training_actions(spec.actions, n, rng)
        poses = fastar.photo_world.place(fastar.actions.integrate(torch.from_numpy(a), spec.actions),
                                    tuple(photo.shape[1:]), spec.view, rng)
        if poses is None:
            continue
        frames.append(fastar.photo_world.render(photo, poses.to(device), spec.view).transpose(0, 1))
        actions.append(torch.from_numpy(a))
    return torch.stack(frames), torch.stack(actions).to(device)


def teacher_forcing_mask(sequences: int, latent_frames: int, tokens: int):
    """The attention rule over [clean frames | noisy frames] per trajectory, as a function of token indices."""
    span = 2 * latent_frames

    def allowed(b, h, q, k):
        fq, fk = q // tokens, k // tokens
        same = fq // span == fk // span
        wq, wk = fq % span, fk % span
        nq, nk = wq >= latent_frames, wk >= latent_frames
        cq, ck = (wq % latent_frames) // CHUNK, (wk % latent_frames) // CHUNK
        clean = ~nq & ~nk & (ck <= cq)
        noisy = nq & ((~nk & (ck < cq)) | (nk & (ck == cq)))
        return same & (clean | noisy)

    return allowed


class TeacherForcing:
    """The attention state of a training forward: every self-attention call under the teacher-forcing mask
    (FlexAttention on the GPU, a dense mask on the CPU). The model's q/k/v come in [B, L, H, D]."""
    graph_safe = False

    def __init__(self, allowed, length: int, device):
        self.device = device
        if device.type == "cuda":
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            self.mask = create_block_mask(allowed, None, None, length, length, device=device)
            self.flex = torch.compile(flex_attention)
        else:
            i = torch.arange(length)
            self.mask = allowed(0, 0, i[:, None], i[None])

    def kv_rows(self, layer):
        return None

    def q_rows(self, layer):
        return None

    def self_attention(self, layer, q, k, v):
        q, k, v = (t.transpose(1, 2).to(torch.bfloat16 if self.device.type == "cuda" else t.dtype) for t in (q, k, v))
        if self.device.type == "cuda":
            out = self.flex(q, k, v, block_mask=self.mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        return out.transpose(1, 2)


def loss_of(model, spec, frames, actions, step, seed, sigmas, attention):
    """The flow-matching loss of one batch."""
    b = frames.shape[0]
    x0 = spec.encode(frames)                                   # [B, C, T, h, w]
    t = x0.shape[2]
    g = torch.Generator(device=frames.device).manual_seed(seed * 1_000_003 + step)
    chunks = t // CHUNK
    grid = torch.tensor(sigmas, device=frames.device)
    pick = torch.randint(len(sigmas), (b, chunks), generator=g, device=frames.device)
    sigma = torch.where(torch.rand(b, chunks, generator=g, device=frames.device) < 0.5, grid[pick],
                        torch.rand(b, chunks, generator=g, device=frames.device))
    sigma = sigma.repeat_interleave(CHUNK, 1)                  # [B, T]
    noise = torch.randn(x0.shape, generator=g, device=frames.device)
    s = sigma[:, None, :, None, None]
    v = noisy_flow(model, spec, x0, (1 - s) * x0 + s * noise, 1000 * sigma, actions, attention)
    return F.mse_loss(v.float(), (noise - x0).float())


def noisy_flow(model, spec, x0, xt, timesteps, actions, attention):
    """The model's flow for noisy latents xt [B, C, T, h, w] at ``timesteps`` [B, T] over clean history x0
    (same shape), every trajectory's clean frames then its noisy ones in one sequence of frames under
    ``attention`` (``TeacherForcing``): what the rollout computes chunk by chunk over a dense cache."""
    b, _, t = x0.shape[:3]
    x = torch.cat([x0, xt], 2)                                 # [B, C, 2T, h, w]: clean, then noisy
    steps = torch.cat([torch.zeros_like(timesteps), timesteps], 1)
    mean, condition = model.steering(spec.context(actions))   # [B, T, 3], [B, T, A]
    times = torch.arange(t, device=x0.device, dtype=torch.float64)
    fold = lambda z: torch.cat([z, z], 1).flatten(0, 1)[None]  # noqa: E731  [1, B * 2T, ...]
    v = model.run(x.transpose(1, 2).flatten(0, 1).transpose(0, 1)[None], steps.flatten()[None],
                  fold(mean), fold(condition), torch.cat([times, times]).repeat(b), attention)
    return v[0].transpose(0, 1).unflatten(0, (b, 2 * t))[:, t:].transpose(1, 2)


def save(out, model, opt, state):
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    weights = model.state_dict()
    names, sizes = sorted(weights), [weights[k].numel() for k in sorted(weights)]
    half = int(np.searchsorted(np.cumsum(sizes), sum(sizes) / 2)) + 1  # two files of about equal size
    for i, part in enumerate((names[:half], names[half:])):
        save_file({k: weights[k].float().contiguous() for k in part}, os.path.join(out, f"ckpt_weights_{i}.safetensors"))
    params = dict(model.named_parameters())
    save_file({k: opt.state[p]["exp_avg_sq"].to(torch.bfloat16).contiguous() for k, p in params.items()
               if p in opt.state}, os.path.join(out, "ckpt_exp_avg_sq.safetensors"))
    device = state["runs"][-1]["device"] if state["runs"] else None
    with open(os.path.join(out, "world_train.json"), "w") as f:  # a result file's keys first (bench/common)
        json.dump({"device": device, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, **state}, f,
                  indent=1)


def export(model, state, path):
    """The model as it is committed and loaded: bf16, with its config, world, sampling and training record."""
    training = {k: state[k] for k in ("step", "steps", "seed", "sequences", "latent_frames", "lr", "runs",
                                      "commit", "dirty", "command")}
    fastar.models.world.save_world(model, path, SAMPLING, training=training)


def resume(folder, model, opt, device):
    from safetensors.torch import load_file

    weights = {}
    for i in range(2):
        weights.update(load_file(os.path.join(folder, f"ckpt_weights_{i}.safetensors"), device=str(device)))
    model.load_state_dict(weights)
    second = load_file(os.path.join(folder, "ckpt_exp_avg_sq.safetensors"), device=str(device))
    with open(os.path.join(folder, "world_train.json")) as f:
        state = {k: v for k, v in json.load(f).items() if k not in ("device", "date", "torch")}
    for k, p in model.named_parameters():
        if k in second:  # the first moment, a memory of ~10 steps, restarts from zero
            opt.state[p] = {"step": torch.tensor(float(state["step"])), "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": second[k].float()}
    return state


def plot(state, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses = zip(*state["loss"]) if state["loss"] else ((), ())
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, losses)
    ax.set(xlabel="step", ylabel="flow-matching loss (mean of 50 steps)", yscale="log",
           title=f"world model training: {sum(r['minutes'] for r in state['runs']):.1f} min on "
                 f"{state['runs'][-1]['device']}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = parser(__doc__, smoke=True)
    p.add_argument("--resume", help="a folder a run wrote (its state continues)")
    p.add_argument("--minutes", type=float, default=9.0, help="training minutes in this run")
    p.add_argument("--steps", type=int, default=0, help="the cosine schedule's length (a fresh run; 0: from "
                   "--total-minutes)")
    p.add_argument("--total-minutes", type=float, default=15.0, help="training minutes over all runs, where --steps is 0")
    p.add_argument("--device", help="default: cuda (cpu with --smoke)")
    p.add_argument("--export", help="write the model as committed (bf16 safetensors) to this path at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sequences", type=int, default=2, help="trajectories per step")
    p.add_argument("--latent-frames", type=int, default=48, help="latent frames per trajectory (a multiple of 3)")
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--placement", choices=fastar.models.world.PLACEMENTS, default="world",
                   help="a token's RoPE: its place in the world, or on the screen and in time (Matrix-Game "
                        "2.0's): the screen-placed twin (a fresh run; a resumed one keeps its own)")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    torch.manual_seed(args.seed)
    placement = args.placement
    if args.resume:
        with open(os.path.join(args.resume, "world_train.json")) as f:
            placement = json.load(f).get("placement", "world")
    spec = fastar.models.world.WorldSpec(placement=placement)
    size = dict(dim=32, ffn_dim=64, num_heads=2, num_layers=2, action_layers=1) if args.smoke else {}
    model = fastar.models.world.WorldModel(fastar.models.world.world_config(spec, **size), spec)
    model = init_weights(model, args.seed).to(device).train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.01)
    state = {"step": 0, "steps": args.steps or 10 ** 9, "seed": args.seed, "sequences": args.sequences,
             "latent_frames": args.latent_frames, "lr": args.lr, "placement": placement, "loss": [], "runs": [],
             **provenance(argv)}
    if args.resume:
        state = resume(args.resume, model, opt, device)
    worlds = photos("train", device)
    tokens = (spec.view // spec.unshuffle // model.config.patch_size[1]) ** 2
    length = state["sequences"] * 2 * state["latent_frames"] * tokens
    attention = TeacherForcing(teacher_forcing_mask(state["sequences"], state["latent_frames"], tokens), length,
                               device) if args.minutes > 0 else None
    sigmas = fastar.FlowMatchSchedule(SAMPLER, SHIFT).sigmas()
    tic, window, last_save = time.time(), [], state["step"]
    print(f"training on {device_name(device)} from step {state['step']} of {state['steps']}; "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters", flush=True)
    while state["step"] < state["steps"] and time.time() - tic < args.minutes * 60:
        step = state["step"]
        lr = state["lr"] * min(1.0, (step + 1) / 200) * (0.55 + 0.45 * math.cos(math.pi * step / state["steps"]))
        for group in opt.param_groups:
            group["lr"] = lr
        frames, actions = batch(spec, worlds, step, state["seed"], state["sequences"], state["latent_frames"], device)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss = loss_of(model, spec, frames, actions, step, state["seed"], sigmas, attention)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        window.append(loss.detach())
        state["step"] += 1
        if not args.resume and not args.steps and state["step"] in (10, 40):  # the pace, between steps 10 and 40
            if state["step"] == 10:
                torch.cuda.synchronize() if device.type == "cuda" else None
                pace = time.time()
            else:
                torch.cuda.synchronize() if device.type == "cuda" else None
                per_step = (time.time() - pace) / 30
                state["steps"] = int(args.total_minutes * 60 / per_step)
                print(f"{per_step * 1000:.0f} ms a step: {state['steps']} steps in {args.total_minutes} min", flush=True)
        if len(window) == 50 or state["step"] == state["steps"]:
            mean = torch.stack(window).mean().item()
            state["loss"].append([state["step"], round(mean, 5)])
            window = []
            print(f"step {state['step']:6d}  loss {mean:.4f}  lr {lr:.2e}  {(time.time() - tic) / 60:.1f} min", flush=True)
        if state["step"] - last_save >= args.save_every:
            last_save = state["step"]
            save(args.out, model, opt, {**state, "runs": state["runs"] + [run_record(device, tic)]})
    if args.minutes > 0:
        state["runs"].append(run_record(device, tic))
        save(args.out, model, opt, state)
        plot(state, os.path.join(args.out, "world_train_loss.png"))
        print(f"saved step {state['step']} to {args.out} ({state['runs'][-1]['minutes']:.1f} min this run)")
    if args.export:
        export(model, state, args.export)
        print(f"exported the model at step {state['step']} to {args.export}")


def run_record(device, tic) -> dict:
    return {"device": device_name(device), "minutes": round((time.time() - tic) / 60, 2),
            "date": time.strftime("%Y-%m-%d"), "command": provenance()["command"]}


if __name__ == "__main__":
    main()
