"""AnnSA's fixed-share plans measured on a layer's captured queries and keys (bench/ann_bench.py,
bench/ann_bound.py)."""
from __future__ import annotations

import dataclasses
import math
import statistics

import torch

from . import fastar, op_ms, side_by_side_ms  # (fastar: this checkout, imported as comfyui_fastar)
from .testbed import CHUNK

from comfyui_fastar.fastar.annsa import KEY_BLOCK
from comfyui_fastar.fastar.attention import build_ann
from comfyui_fastar.testing.annsa import plan_density, recall
from comfyui_fastar.kernels.quant_block_scores import quant_block_scores_auto, quant_block_scores_torch
from comfyui_fastar.kernels.quant_select import quant_select_auto, quant_select_torch

CacheConfig, make_cache, attend = fastar.CacheConfig, fastar.make_cache, fastar.attend

def measure(cfg, kv_dense, layer, clean_q, query_q, history_frames):
    """One layer's history replayed into an unbounded cache, the next chunk's queries planned by
    ``cfg`` (a fixed-share quant plan) and attended: recall, density, error, times."""
    heads, d, device = kv_dense.num_heads, kv_dense.head_dim, kv_dense.device
    tpf = kv_dense.tokens_per_frame
    kv = make_cache(CacheConfig("unbounded"), num_layers=1, batch=1, num_heads=heads, head_dim=d, tokens_per_frame=tpf,
                    chunk_frames=CHUNK, max_frames=history_frames + CHUNK, device=device, dtype=kv_dense.dtype)
    annsa, _ = build_ann(dataclasses.replace(cfg, annca=False), kv)
    for c in range(history_frames // CHUNK):
        span = slice(c * CHUNK * tpf, (c + 1) * CHUNK * tpf)
        kv.begin_chunk(c * CHUNK, CHUNK)
        kv.begin_clean_pass()
        kv.attend(0, kv_dense.k[layer, :, span], kv_dense.v[layer, :, span])
        annsa.index_history(0)
        kv.commit()
    own = slice(history_frames * tpf, (history_frames + CHUNK) * tpf)
    kv.begin_chunk(history_frames, CHUNK)
    keys, values, bias = kv.attend(0, kv_dense.k[layer, :, own], kv_dense.v[layer, :, own])
    q = query_q[layer]
    plan = annsa.plan(0, q)
    every = 10**6  # sample every query block
    kept = recall(annsa, q, keys, bias, plan, sample_blocks=every).item()
    history_recall = recall(annsa, q, keys, bias, plan, sample_blocks=every, history_only=True).item()
    density = plan_density(*plan, keys.shape[1]).item()
    out = annsa.attention(0, q, keys, values, bias, plan)
    dense = attend(q, keys, values)
    err = ((out.float() - dense.float()).norm() / dense.float().norm()).item()
    row = {"recall": kept, "history_recall": history_recall, "density": density, "rel_error": err,
           "ranges_per_block": plan[1].float().mean().item()}
    # the planning kernels against their twins, on this device's data
    k8, logit_scale, log_mass, held = annsa.reps[0]
    args = (q.transpose(1, 2), k8, logit_scale, log_mass, cfg.block_q)
    got, want = quant_block_scores_auto(*args), quant_block_scores_torch(*args)
    row["scores_equal_twin"] = bool(torch.equal(got, want))  # the kernel does not fuse multiply-adds
    rows = kv.layout.history
    top = math.ceil(cfg.keep_fraction * log_mass.shape[-1])  # as the plan picks
    chunk = kv.layout.chunk
    sel = dict(key_block=KEY_BLOCK, rows_start=rows.start, rows_stop=rows.stop, sink=kv.layout.sink,
               chunk_start=chunk.start, chunk_stop=chunk.stop)
    picked, picked_twin = quant_select_auto(want, held, top, **sel), quant_select_torch(want, held, top, **sel)
    row["select_equals_twin"] = all(torch.equal(a, b) for a, b in zip(picked, picked_twin))
    t_plan = op_ms(lambda: annsa.plan(0, q), device)
    t_sparse = op_ms(lambda: annsa.attention(0, q, keys, values, bias, plan), device)
    t_dense = op_ms(lambda: attend(q, keys, values), device)
    # GPU time alone, as in a rollout where the host runs ahead: the whole call (plan included) and
    # dense cuDNN, each replayed from a CUDA graph, taking turns; the ratio is the median over rounds
    gpu = side_by_side_ms({"call": lambda: annsa.attention(0, q, keys, values, bias),
                           "dense": lambda: attend(q, keys, values)}, device)
    row["call_graph_ms"], row["dense_graph_ms"] = statistics.median(gpu["call"]), statistics.median(gpu["dense"])
    row["call_over_dense_graph"] = statistics.median(c / d for c, d in zip(gpu["call"], gpu["dense"]))
    return {**row, "plan_ms": t_plan, "sparse_ms": t_sparse, "dense_cudnn_ms": t_dense,
            "speedup_incl_plan": t_dense / (t_plan + t_sparse)}
