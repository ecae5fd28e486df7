"""Per-head budgets (Forcing-KV, arXiv 2605.09681) on TempCache, measured before building them into the pack
(not built: on the testbed no split moved FAST-AR's front, bench/NOTES.md).

Forcing-KV gives each head its own policy: "static" heads, whose attention stays on the open chunk, keep a short
budget; "dynamic" heads keep the history. Here a static head reads only the keys every query reads unbiased
(TempCache's sink and the open chunk: ``Layout.fixed``), a dynamic head all of TempCache's keys with their log m
bias. Heads are ranked per layer by the attention mass they put on the history (softmax with log m, every
forward of ``--classify-chunks`` generated chunks after the real clip's first frames, sampled queries), and the
``f`` share with the least mass turns static; the control turns the same share static from the most mass down.

  speed     ms per chunk at steady state (CUDA graphs, the median of the last 5 of a rollout whose cache is full
            for them), settings taking turns over ``--repeats`` rounds in one process: sink 3 + window 12,
            TempCache 12, TempCache 12 / 21 with f of the heads static. The split gathers each call's heads
            (index_select) and scatters the output back: a cost a head permutation of the weights would remove,
            so these times bound the layout's from above.
  fidelity  as bench/frontier.py: after 81 and 240 cached real frames, 2 generated chunks against dense bf16
            (PSNR / SSIM), with the own-chunk control.

The testbed's weights are random (sensitized, bench/common/testbed.py): head roles are a property of trained
checkpoints, so the split found here says how much the history of the least-attending heads is worth on this
testbed, not on a trained model.

    python bench/head_budgets.py --prompt wan|random --out bench/results    # H200 ~3 min a prompt
    python bench/head_budgets.py --smoke --out /tmp                          # tiny model on the CPU
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fastar, header, parser, shapes, write_json  # noqa: E402
from common.realvideo import real_latents  # noqa: E402
from common.rollouts import SETTINGS, Fidelity, chunks_for, make_run, real_rollout, steady_state  # noqa: E402
from common.testbed import CHUNK, RealVideoHistory, generate, testbed  # noqa: E402

T, W = fastar.TempCacheConfig, fastar.CacheConfig
SAMPLED_QUERIES = 256


class HistoryMass(fastar.FastARAttention):
    """Dense TempCache attention that adds up, per layer and head, the softmax mass sampled queries put on
    the history rows (log m included)."""

    graph_safe = False

    def __init__(self, cache):
        super().__init__(cache)
        self.mass = torch.zeros(cache.num_layers, cache.num_heads, device=cache.device, dtype=torch.float64)
        self.calls = torch.zeros(cache.num_layers, device=cache.device, dtype=torch.float64)
        self.recording = False

    def self_attention(self, layer, q, k, v):
        if self.recording:
            keys, _, bias = self.cache.attend(layer, k, v)
            rows = torch.randperm(q.shape[1], device=q.device)[:SAMPLED_QUERIES]
            logits = torch.einsum("bqhd,bkhd->bhqk", q[:, rows].float(), keys.float()) * q.shape[-1] ** -0.5
            p = (logits + bias.unsqueeze(2)).softmax(-1)
            self.mass[layer] += p[..., self.cache.layout.history].sum(-1).mean((0, 2)).double()
            self.calls[layer] += 1
        return super().self_attention(layer, q, k, v)


def history_mass(model, context, hw, prefix, chunks):
    """[layers, heads] mean history mass over every forward of ``chunks`` chunks generated on TempCache 12
    after ``prefix`` real frames."""
    run = make_run(model, context, prefix + chunks * CHUNK, hw, "tempcache12", attention=HistoryMass,
                   cuda_graphs=False, settings=grid()[0])
    with torch.inference_mode():
        RealVideoHistory(run, real_latents(prefix, *hw).to(context.device)).to(prefix)
        run.attention.recording = True
        generate(run, chunks)
    return (run.attention.mass / run.attention.calls.unsqueeze(1)).float().cpu()


class HeadBudgets(fastar.FastARAttention):
    """TempCache attention whose static heads (per layer) read only ``Layout.fixed``, the sink and the open
    chunk, once the sink is whole; the others read every key with its log m bias. Static per layer, so
    graph-safe."""

    def __init__(self, cache, static: list[list[int]]):
        super().__init__(cache)
        self.split = []
        for heads in static:
            s = torch.tensor(sorted(heads), dtype=torch.long)
            d = torch.tensor([h for h in range(cache.num_heads) if h not in heads], dtype=torch.long)
            order = torch.cat([s, d]).argsort()
            self.split.append(tuple(t.to(cache.device) for t in (s, d, order)) if len(heads) else None)

    def self_attention(self, layer, q, k, v):
        layout = self.cache.layout
        fixed = layout.fixed  # None while the sink fills: no history yet
        if self.split[layer] is None or fixed is None:
            return super().self_attention(layer, q, k, v)
        s, d, order = self.split[layer]
        keys, values, bias = self.cache.attend(layer, k, v)
        o_s = fastar.attend(q.index_select(2, s), keys[:, fixed].index_select(2, s),
                            values[:, fixed].index_select(2, s))
        o_d = self.backend.biased(q.index_select(2, d), keys.index_select(2, d), values.index_select(2, d),
                                  bias.index_select(1, d), layout.bias)
        if self.cache.clean_pass:
            self.write_history(layer, q)
        return torch.cat([o_s, o_d], 2).index_select(2, order)


def split_heads(mass: torch.Tensor, share: float, least: bool = True) -> list[list[int]]:
    """Per layer, the ``share`` of heads with the least (or most) history mass."""
    n = round(share * mass.shape[1])
    order = mass.argsort(1, descending=not least)
    return [sorted(order[layer, :n].tolist()) for layer in range(mass.shape[0])]


def grid(mass=None, shares=(), budgets=(12, 21)) -> tuple[dict, dict]:
    """(settings, static heads): settings as common.rollouts.make_run takes them, the window and TempCache
    references and per budget and share the split by least mass (``tempcacheB-sF``) and, at the largest share,
    by most (``-most``); per split setting its static heads, layer by layer."""
    settings = {"dense": SETTINGS["dense"], "window12": (W("window", 3, 12), None)}
    for b in budgets:
        settings[f"tempcache{b}"] = (T(max_cache_frames=b), None)
    statics = {}
    for b in budgets if mass is not None else ():
        for share in shares:
            for least in (True, False) if share == max(shares) else (True,):
                name = f"tempcache{b}-s{share:g}" + ("" if least else "-most")
                static = statics[name] = split_heads(mass, share, least)
                settings[name] = (T(max_cache_frames=b), None,
                                  {"attention": lambda cache, static=static: HeadBudgets(cache, static)})
    return settings, statics


def main():
    p = parser(__doc__, smoke=True)
    p.add_argument("--prompt", choices=("random", "wan"), default="random")
    p.add_argument("--shares", default="0.25,0.5", help="shares of static heads (comma-separated)")
    p.add_argument("--classify-chunks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="rounds of the timed settings")
    p.add_argument("--horizons", default="81,240")
    args = p.parse_args()
    device, size, hw = shapes(args.smoke)
    horizons = [9, 15] if args.smoke else [int(h) for h in args.horizons.split(",")]
    shares = [float(s) for s in args.shares.split(",")]
    budgets = (6, 9) if args.smoke else (12, 21)
    model, context = testbed(size=size, device=str(device), prompt=args.prompt)
    tic = time.time()

    mass = history_mass(model, context, hw, 6 if args.smoke else 27, args.classify_chunks)
    print(f"[{time.time() - tic:.0f} s] history mass per head: mean {mass.mean():.3f}, per-layer spread "
          f"(max - min) median {(mass.max(1).values - mass.min(1).values).median():.3f}", flush=True)
    settings, statics = grid(mass, shares, budgets)

    timed = [n for n in settings if n != "dense" and not n.endswith("-most")]
    speed = {n: [] for n in timed}
    for _ in range(args.repeats):
        for name in timed:
            cache = settings[name][0]
            chunks = chunks_for(cache.sink_frames + cache.history_frames)
            rows = real_rollout(model, context, chunks, hw, name, log_every=10 ** 6, settings=settings)
            speed[name].append(steady_state(rows)["ms"])
            print(f"[{time.time() - tic:.0f} s] {name}: {speed[name][-1]:.1f} ms/chunk", flush=True)

    fid = Fidelity(model, None, context, horizons, hw, 2 * CHUNK, settings=settings, floor_horizons=[])
    fid.references()
    for names in fid.groups():
        fid.measure(names)
    table = fid.table()

    rows = {}
    for name in settings:
        if name == "dense":
            continue
        rows[name] = {"ms": statistics.median(speed[name]) if name in speed else None,
                      "round_ms": speed.get(name),
                      **{f"psnr_{h}": round(t[name]["psnr"], 2) for h, t in zip(horizons, table) if name in t}}
    base = rows["window12"]["ms"]
    print(f"\n{'setting':24s} {'ms/chunk':>9s} {'x window12':>10s} " + " ".join(f"{'dB@' + str(h):>8s}" for h in horizons))
    for name, r in rows.items():
        ms = f"{r['ms']:9.1f} {r['ms'] / base:10.3f}" if r["ms"] else f"{'-':>9s} {'-':>10s}"
        print(f"{name:24s} {ms} " + " ".join(f"{r.get(f'psnr_{h}', float('nan')):8.2f}" for h in horizons))
    own = {h: round(t["own_chunk_only"]["psnr"], 2) for h, t in zip(horizons, table)}
    print("own-chunk control:", own)
    write_json(args.out, "head_budgets" + ("_wan" if args.prompt == "wan" else "") + ("_smoke" if args.smoke else "")
               + ".json",
               {**header(device), "prompt": args.prompt, "shapes": {"height": hw[0], "width": hw[1], "chunk_frames":
                                                                  CHUNK, "size": size},
                "testbed": "sensitized random weights (bench/common/testbed.py)", "shares": shares,
                "history_mass": [[round(x, 4) for x in row] for row in mass.tolist()],
                "static_heads": statics,
                "settings": rows, "own_chunk_only": own, "horizons": horizons})


if __name__ == "__main__":
    main()
