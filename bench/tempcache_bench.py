"""TempCache on the H200: fidelity on real-video keys and speed at Wan 2.1 1.3B shapes.

Fidelity. The three real clips (bench/common/realvideo.py) become latents-like inputs at 30x52 tokens per
frame and run, teacher-forced, through the 1.3B-shaped model (random weights, bf16): the clean
pass of each 3-frame chunk fills a dense cache, recording every layer's K/V and clean-pass
queries. For a sweep of (budget, threshold), each measured layer's chunks
are replayed into a TempCache through the cache protocol, and the next chunk's queries (a
denoising step at sigma 0.625) attend the compressed cache. Reported per setting:
  merge ratio   merged / non-sink tokens written
  recall        sum_g min(P_tc(g), sum_{j in g} p_dense(j)): the dense attention mass the compressed
                attention keeps, per merged group (evicted tokens: 0; sink and own chunk per token)
  recall_token  the stricter token-level overlap, a group's mass spread evenly over its members
  rel. error    |out_tc - out_dense| / |out_dense| of the attention output
with the same-budget sink + window cache (and eviction-only TempCache) as the baseline.

Speed. (1) one TempCache write (correspondence + merge, one layer, full budget) against the
dense attention time it saves at 81 cached frames (5 forwards); (2) a 240-chunk rollout with
the default TempCache: per-chunk latency and peak memory must stay flat (last/first <= 1.1).

    python bench/tempcache_bench.py --out bench/results
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_ms, fastar, header, parser, write_json  # noqa: E402
from common.testbed import CHUNK, HEIGHT, SINK, TPF, WIDTH, capture, testbed  # noqa: E402

CacheConfig, TempCacheConfig, make_cache = fastar.CacheConfig, fastar.TempCacheConfig, fastar.make_cache
Rollout, attend = fastar.Rollout, fastar.attend


def replay(cfg, kv_dense, layer, clean_q, query_q, history_frames, n_queries=384):
    """Write one layer's history into a cache of config ``cfg``; attend the next chunk's queries."""
    n_chunks = history_frames // CHUNK
    heads, d = kv_dense.num_heads, kv_dense.head_dim
    tc_cfg = isinstance(cfg, TempCacheConfig)
    kv = make_cache(cfg, num_layers=1, batch=1, num_heads=heads, head_dim=d, tokens_per_frame=TPF,
                    chunk_frames=CHUNK, max_frames=history_frames + CHUNK, device="cuda", dtype=kv_dense.dtype)
    n_all = (history_frames + CHUNK) * TPF
    owner = torch.full((heads, n_all), -1, dtype=torch.long, device="cuda")  # slot of each token (-1 evicted)
    written = merged = 0
    slots_of = []  # the history slot of each token of the last merge (TempCache's observer)
    if tc_cfg:
        kv.observer = lambda layer, b, slots: slots_of.append(slots)
    for c in range(n_chunks):
        span = slice(c * CHUNK * TPF, (c + 1) * CHUNK * TPF)
        kv.begin_chunk(c * CHUNK, CHUNK)
        kv.begin_clean_pass()
        kv.attend(0, kv_dense.k[layer, :, span], kv_dense.v[layer, :, span])
        kv.write_history(0, clean_q[layer][c])
        kv.commit()
        if not tc_cfg:
            continue
        n_sink = max(0, min(CHUNK, SINK - c * CHUNK)) * TPF
        new = slice(span.start + n_sink, span.stop)
        if new.stop > new.start:
            slots = slots_of.pop()
            _, _, log_m = kv.held_keys(0, kv.history)
            placed = log_m[0].gather(1, slots.clamp_min(0)) == 0  # a group of one: a newly placed token
            for h in range(heads):  # tokens whose slot a newly placed token took are evicted
                taken = slots[h][placed[h]]
                old = owner[h, :new.start]
                owner[h, :new.start] = torch.where(torch.isin(old, taken), -1, old)
            owner[:, new] = slots
            written += (new.stop - new.start)
            merged += kv.stats().merged

    # the query chunk over the compressed cache and over the dense one
    q = query_q[layer]
    own = slice(history_frames * TPF, n_all)
    kv.begin_chunk(history_frames, CHUNK)
    keys, values, bias = kv.attend(0, kv_dense.k[layer, :, own], kv_dense.v[layer, :, own])
    sink_tok, chunk, hist = kv.layout.sink, kv.layout.chunk, kv.layout.history
    out = attend(q, keys, values, key_bias=bias)
    dense = attend(q, kv_dense.k[layer, :, :n_all], kv_dense.v[layer, :, :n_all])
    err = ((out.float() - dense.float()).norm() / dense.float().norm()).item()

    # recall: overlap of the two attention distributions over the original tokens
    g = torch.Generator(device="cuda").manual_seed(layer)
    pick = torch.randperm(q.shape[1], device="cuda", generator=g)[:n_queries]
    scale = d ** -0.5
    recalls, group_recalls, hist_recalls = [], [], []
    for h in range(heads):
        qh = q[0, pick, h].float()
        p_dense = torch.softmax(qh @ kv_dense.k[layer, 0, :n_all, h].float().T * scale, dim=-1)
        logits = qh @ keys[0, :, h].float().T * scale
        if bias is not None:
            logits = logits + bias[0, h][None]
        p_c = torch.softmax(logits, dim=-1)
        p_tok = torch.zeros_like(p_dense)
        if tc_cfg:  # group level: a group keeps min(its compressed mass, its members' dense mass)
            o = owner[h, sink_tok:own.start]  # each original history token's slot (-1: evicted)
            m_slots = hist.stop - hist.start
            dense_groups = torch.zeros(p_dense.shape[0], m_slots + 1, device="cuda")
            dense_groups.scatter_add_(1, torch.where(o >= 0, o, m_slots).expand(p_dense.shape[0], -1),
                                      p_dense[:, sink_tok:own.start])
            hist_kept = torch.minimum(dense_groups[:, :-1], p_c[:, hist]).sum(-1)
            group_recall = (torch.minimum(p_dense[:, :sink_tok], p_c[:, :sink_tok]).sum(-1) + hist_kept
                            + torch.minimum(p_dense[:, own], p_c[:, chunk]).sum(-1))
            group_recalls.append(group_recall.mean().item())
            hist_recalls.append((hist_kept.sum() / p_dense[:, sink_tok:own.start].sum()).item())
            p_tok[:, :sink_tok] = p_c[:, :sink_tok]
            cnt = kv.held_keys(0, hist)[2][0, h].exp()  # each slot's group size m (0: empty)
            contrib = p_c[:, hist.start + o.clamp_min(0)] / cnt[o.clamp_min(0)].clamp_min(1)
            p_tok[:, sink_tok:own.start] = torch.where((o >= 0)[None], contrib, 0.0)
        else:  # sink + window cache: a frame slot holds the last frame the ring put there
            for slot, frame in {kv.frame_slot(f): f for f in range(kv.frames_cached)}.items():
                p_tok[:, frame * TPF:(frame + 1) * TPF] = p_c[:, slot * TPF:(slot + 1) * TPF]
        p_tok[:, own] = p_c[:, chunk]
        recalls.append(torch.minimum(p_dense, p_tok).sum(-1).mean().item())
    token_recall = statistics.mean(recalls)
    return {"merge_ratio": merged / written if written else 0.0,
            "recall": statistics.mean(group_recalls) if group_recalls else token_recall,
            "recall_token": token_recall, "rel_error": err,
            "recall_history": statistics.mean(hist_recalls) if hist_recalls else float("nan")}


def main():
    ap = parser(__doc__)
    ap.add_argument("--history-frames", type=int, default=81)
    ap.add_argument("--layers", default="0,9,19,29")
    ap.add_argument("--thresholds", default="0.6,0.7,0.8,0.85,0.9,0.93,0.95,0.97")
    ap.add_argument("--budgets", default="21,42")
    ap.add_argument("--rollout-chunks", type=int, default=240, help="0: skip the long rollout")
    ap.add_argument("--tag", default="tempcache_bench", help="name of the JSON/PNG written")
    ap.add_argument("--fidelity-only", action="store_true", help="skip the speed measurements")
    args = ap.parse_args()
    model, context = testbed()
    layers = [int(x) for x in args.layers.split(",")]
    result = {**header("cuda"), "history_frames": args.history_frames, "layers": layers,
              "inputs": "real clips (bench/data) via bench/common/realvideo.real_latents, 480x832, stride 1; "
                        "1.3B-shaped model, random weights sensitized (bench/common/testbed.py), bf16; queries at sigma 0.625"}

    # ---- fidelity sweep --------------------------------------------------------------------
    tic = time.time()
    kv_dense, clean_q, query_q, _ = capture(model, context, args.history_frames, layers)
    print(f"captured {args.history_frames} real frames in {time.time() - tic:.1f} s")
    sweep = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        settings = [("window", CacheConfig("window", SINK, budget - SINK)),
                    ("evict-only", TempCacheConfig(enabled=False, max_cache_frames=budget, sink_frames=SINK))]
        settings += [(f"merge/{thr}", TempCacheConfig(merge_threshold=thr, max_cache_frames=budget, sink_frames=SINK))
                     for thr in [float(t) for t in args.thresholds.split(",")]]
        for name, cfg in settings:
            rows = [replay(cfg, kv_dense, layer, clean_q, query_q, args.history_frames) for layer in layers]
            row = {"budget_frames": budget, "setting": name,
                   **{k: statistics.mean(r[k] for r in rows) for k in rows[0]},
                   "per_layer": rows}
            sweep.append(row)
            print(f"budget {budget:3d} {name:22s} merge {row['merge_ratio']:.3f} recall {row['recall']:.4f} "
                  f"token-recall {row['recall_token']:.4f} history {row['recall_history']:.4f} "
                  f"err {row['rel_error']:.4f}")
    result["fidelity"] = sweep
    del kv_dense, clean_q, query_q
    torch.cuda.empty_cache()
    if args.fidelity_only:
        write_json(args.out, args.tag + ".json", result)
        return

    # ---- speed: one write vs the attention it saves ------------------------------------------
    cfg = TempCacheConfig()
    heads, d = model.num_heads, model.head_dim
    g = torch.Generator(device="cuda").manual_seed(1)
    kv = make_cache(cfg, num_layers=1, batch=1, num_heads=heads, head_dim=d, tokens_per_frame=TPF,
                    chunk_frames=CHUNK, device="cuda", dtype=torch.bfloat16)
    base = torch.randn(1, CHUNK * TPF, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)

    def write(noise=0.3):
        k = base + noise * torch.randn(base.shape, device="cuda", dtype=base.dtype, generator=g)
        kv.begin_chunk(kv.frames_cached, CHUNK)
        kv.begin_clean_pass()
        kv.attend(0, k, k)
        kv.write_history(0, k)
        kv.commit()
    for _ in range(cfg.max_cache_frames // CHUNK + 1):
        write()  # fill the budget
    kv.begin_chunk(kv.frames_cached, CHUNK)
    kv.begin_clean_pass()
    kv.attend(0, base, base)
    t_write = cuda_ms(lambda: kv.write_history(0, base))
    # the same write replayed from a CUDA graph: its GPU time without host launch gaps, which is
    # what it adds inside a forward, where the host runs ahead of the device
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            kv.write_history(0, base)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kv.write_history(0, base)
    t_write_graph = cuda_ms(graph.replay)
    keys, values, bias = kv.attend(0, base, base)
    q = torch.randn(1, CHUNK * TPF, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
    t_tc_attn = cuda_ms(lambda: attend(q, keys, values, key_bias=bias))
    t_tc_nobias = cuda_ms(lambda: attend(q, keys, values))
    backends = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def biased():
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                               attn_mask=bias.to(q.dtype).unsqueeze(2))
        try:
            backends[name] = cuda_ms(biased)
        except RuntimeError as exc:
            backends[name] = f"unsupported: {str(exc)[:120]}"
    print("biased SDPA backends at the budget shape:", backends)
    k81 = torch.randn(1, (81 + CHUNK) * TPF, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
    t_dense81 = cuda_ms(lambda: attend(q, k81, k81))
    saved = 5 * (t_dense81 - t_tc_attn)
    result["speed"] = {"write_ms_per_layer_per_chunk": t_write, "write_graph_ms_per_layer_per_chunk": t_write_graph,
                       "write_graph_over_saved": t_write_graph / (5 * (t_dense81 - t_tc_attn)),
                       "attend_budget_with_bias_ms": t_tc_attn,
                       "attend_budget_without_bias_ms": t_tc_nobias, "attend_dense_81_ms": t_dense81,
                       "saved_ms_per_layer_per_chunk": saved, "write_over_saved": t_write / saved,
                       "biased_sdpa_backends_ms": backends}
    print("speed:", result["speed"])
    write_json(args.out, args.tag + ".json", result)  # saved early: the rollout below is the longest part
    del kv, k81, keys, values, bias
    torch.cuda.empty_cache()

    # ---- speed inside the pipeline: merging vs eviction only, same budget ----------------------
    pipeline = {}
    for name, c in (("merge", cfg), ("evict-only", TempCacheConfig(enabled=False))):
        lat = []
        run = Rollout(model, context, frames=(c.max_cache_frames // CHUNK + 16) * CHUNK, height=HEIGHT,
                      width=WIDTH, chunk_frames=CHUNK, cache=c)
        with torch.inference_mode():
            run.run(lambda r: lat.append(1e3 * r.latency_s))
        pipeline[name] = statistics.median(lat[-12:])
    pipeline["merge_minus_evict_ms_per_chunk"] = pipeline["merge"] - pipeline["evict-only"]
    pipeline["per_layer_ms"] = pipeline["merge_minus_evict_ms_per_chunk"] / model.num_layers
    pipeline["per_layer_over_saved"] = pipeline["per_layer_ms"] / result["speed"]["saved_ms_per_layer_per_chunk"]
    result["pipeline"] = pipeline
    print("pipeline:", pipeline)
    write_json(args.out, args.tag + ".json", result)
    if args.rollout_chunks == 0:
        return

    # ---- speed: 240-chunk rollout, flat latency and memory ------------------------------------
    rows = []
    torch.cuda.reset_peak_memory_stats()
    run = Rollout(model, context, frames=args.rollout_chunks * CHUNK, height=HEIGHT, width=WIDTH, chunk_frames=CHUNK,
                  cache=cfg)

    def on_chunk(r):
        if r.chunk % 40 == 0:
            print(f"  chunk {r.chunk}: {1e3 * r.latency_s:.1f} ms, held {r.cache.tokens_held} tokens", flush=True)
        rows.append({"frames": r.frames_done, "latency_ms": 1e3 * r.latency_s, "tokens_held": r.cache.tokens_held,
                     "merged": r.cache.merged, "evicted": r.cache.evicted, "allocated_gb": r.cache.gb,
                     "peak_gb": torch.cuda.max_memory_allocated() / 1e9})
    with torch.inference_mode():
        run.run(on_chunk)
    steady = rows[cfg.max_cache_frames // CHUNK + 1:]
    first = statistics.median(r["latency_ms"] for r in steady[:10])
    last = statistics.median(r["latency_ms"] for r in steady[-10:])
    result["rollout"] = rows
    result["rollout_summary"] = {"chunks": len(rows), "first10_median_ms": first, "last10_median_ms": last,
                                 "last_over_first": last / first, "peak_gb_first": steady[0]["peak_gb"],
                                 "peak_gb_last": steady[-1]["peak_gb"]}
    print("rollout:", {k: round(v, 3) for k, v in result["rollout_summary"].items()})
    write_json(args.out, args.tag + ".json", result)
    plot(result, os.path.join(args.out, args.tag + ".png"))


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax_r, ax_e, ax_t = axes
    for budget in sorted({r["budget_frames"] for r in result["fidelity"]}):
        rows = [r for r in result["fidelity"] if r["budget_frames"] == budget]
        sel = [r for r in rows if r["setting"].startswith("merge/")]
        thr = [float(r["setting"].split("/")[-1]) for r in sel]
        ax_r.plot(thr, [r["recall"] for r in sel], ".-", label=f"budget {budget}")
        ax_e.plot(thr, [r["rel_error"] for r in sel], ".-", label=f"budget {budget}")
        for base, style in (("window", ":"), ("evict-only", "--")):
            r = next(r for r in rows if r["setting"] == base)
            ax_r.axhline(r["recall"], ls=style, color="gray", lw=1)
            ax_e.axhline(r["rel_error"], ls=style, color="gray", lw=1)
    ax_r.axhline(0.93, color="red", lw=0.8)
    ax_r.set(xlabel="merge threshold (key cosine)", ylabel="recall of dense attention mass",
             title="recall (gray: window ··· / evict-only --)")
    ax_e.set(xlabel="merge threshold (key cosine)", ylabel="relative attention-output error", title="output error")
    roll = result["rollout"]
    ax_t.plot([r["frames"] for r in roll], [r["latency_ms"] for r in roll], ".-", label="ms per chunk")
    ax_t2 = ax_t.twinx()
    ax_t2.plot([r["frames"] for r in roll], [r["peak_gb"] for r in roll], "r-", label="peak GB")
    ax_t.set(xlabel="latent frames generated", ylabel="ms per chunk", title="TempCache rollout (default settings)")
    ax_t2.set_ylabel("peak GB", color="r")
    ax_t.set_ylim(bottom=0)
    ax_t2.set_ylim(bottom=0)
    for ax in (ax_r, ax_e):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax_t.grid(alpha=0.3)
    fig.suptitle(f"TempCache, Wan 2.1 1.3B shapes on {result['device']}, {result['date']}: real-video keys "
                 f"({result['history_frames']} cached frames, layers {result['layers']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
