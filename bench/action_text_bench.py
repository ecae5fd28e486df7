"""What reading action text costs at its limit: the Action Schedule's queue-time check (``world_nodes.
vocabulary_check``'s passes: every name known in one match, else ``used_names``; on ComfyUI's event loop), the whole parse (``parse_actions``, at run time on the node's thread)
and a live action's read (``Session.post``, on the event loop), on texts of ``MAX_TEXT`` characters built to
make a backtracking reader try every split (``testing.action_text``) and on a long session's log.

Times are the thread's CPU time (``time.thread_time``), the median of ``--repeats``: what the work costs on
one core, which a busy machine stretches in wall time but not here.

    python bench/action_text_bench.py --out bench/results
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fastar, header, parser, write_json  # noqa: E402,F401  (fastar: the checkout, imported)


def texts(actions) -> dict[str, str]:
    """The adversarial texts at the limit, and a session's log of as many runs as fit in it."""
    from comfyui_fastar.testing.action_text import adversarial

    spec = actions.ActionSpec()
    rng = np.random.default_rng(0)
    rows = np.zeros((12 * 1200, spec.width), np.float32)
    for c in range(1200):  # a new action every chunk: keys and a look the page could send
        rows[12 * c:12 * c + 12, :len(spec.keys)] = rng.random(len(spec.keys)) < 0.3
        rows[12 * c:12 * c + 12, len(spec.keys):] = np.round(rng.uniform(-0.1, 0.1, 2), 2)
    log = actions.actions_text(rows, spec)
    while len(log) > actions.MAX_TEXT:
        rows = rows[:-12]
        log = actions.actions_text(rows, spec)
    return {**adversarial(), "session_log": log}


def cpu_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.thread_time()
        try:
            fn()
        except Exception:  # refused texts: the refusal is the work timed
            pass
        times.append(1e3 * (time.thread_time() - t))
    return statistics.median(times)


def main(argv=None):
    p = parser(__doc__, smoke=True)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    from comfyui_fastar.fastar import actions
    from comfyui_fastar.fastar.play import Session

    from comfyui_fastar.fastar.models.matrix_game import VARIANTS

    spec = actions.ActionSpec()
    specs = [spec] + [v.actions for v in VARIANTS.values()]
    known = actions.vocabulary(n for s in specs for n in actions.action_names(s))

    def queue_check(text):  # as world_nodes.vocabulary_check
        if text.lstrip().startswith("[") or not known.fullmatch(actions.compact(text)):
            for name in actions.used_names(text):
                any(actions.knows(s, name) for s in specs)

    repeats = 2 if args.smoke else args.repeats
    rows = {}
    for name, text in texts(actions).items():
        session = Session(spec)
        rows[name] = {
            "characters": len(text),
            "queue_check_ms": cpu_ms(lambda: queue_check(text), repeats),
            "parse_ms": cpu_ms(lambda: actions.parse_actions(text, spec, 12), repeats),
            "live_post_ms": cpu_ms(lambda: session.post(text[:60000]), repeats),
        }
        print(f"{name:20} check {rows[name]['queue_check_ms']:7.2f} ms  parse {rows[name]['parse_ms']:8.2f} ms  "
              f"live {rows[name]['live_post_ms']:6.3f} ms", flush=True)
    worst = {k: max(r[k] for r in rows.values()) for k in ("queue_check_ms", "parse_ms", "live_post_ms")}
    result = {**header(torch.device("cpu"), argv), "limit_characters": actions.MAX_TEXT,
              "repeats": repeats, "worst": worst, "texts": rows}
    print("worst", worst)
    print("wrote", write_json(args.out, "action_text_bench" + ("_smoke" if args.smoke else "") + ".json", result))
    return result


if __name__ == "__main__":
    main()
