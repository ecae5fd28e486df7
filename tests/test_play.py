"""A live session's two ends (``fastar.play.Session``): the latest action held until the next, taken once per
chunk; one action at a time, in the world's keys."""
import threading

import numpy as np
import pytest

from comfyui_fastar.fastar import FastARError
from comfyui_fastar.fastar.actions import ActionSpec, parse_actions
from comfyui_fastar.fastar.play import Session

SPEC = ActionSpec()


def test_the_latest_action_is_held_until_the_next():
    s = Session(SPEC)
    first = s.take()
    assert first.seq == 0 and first.received is None and not first.row.any()  # idle before any post
    assert s.post("W+D")[0] == 1
    assert s.post("look_left")[0] == 2
    taken = s.take()
    assert taken.seq == 2 and np.array_equal(taken.row, parse_actions("look_left", SPEC, 1)[0])
    again = s.take()  # sticky: nothing new posted
    assert again.seq == 2 and np.array_equal(again.row, taken.row) and again.taken >= taken.taken >= taken.received
    taken.row[:] = 7  # a taken row is the chunk's own
    assert not (s.take().row == 7).any()


@pytest.mark.parametrize("action, says", [("jump", "unknown action 'jump'"), ("W*2", "one item with no count"),
                                          ("W, D", "one item with no count"), ("", "no action")])
def test_a_bad_action_is_refused_and_the_held_one_kept(action, says):
    s = Session(SPEC)
    s.post("A")
    with pytest.raises(FastARError, match=says):
        s.post(action)
    assert s.take().seq == 1


def test_posts_from_threads_are_numbered_once_each():
    s = Session(SPEC)
    threads = [threading.Thread(target=lambda: [s.post("W") for _ in range(50)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.take().seq == 200


def test_a_slow_pages_outbox_keeps_its_newest_frames_and_messages_within_its_bounds():
    """A page that never reads: the outbox holds at most its frames and messages, the newest of each, in
    the order they were put, and counts what it dropped; the end (the last message) always stays."""
    import asyncio

    from comfyui_fastar.nodes.play_routes import Outbox

    async def run():
        box = Outbox(frames=3, messages=4)
        for i in range(50):
            box.put(f"chunk {i}")
            box.put(bytes([i]) * 2)
            box.put(bytes([i + 100]) * 2)
        box.put("end")
        return box, [await box.get() for _ in range(len(box.items))]

    box, kept = asyncio.run(run())
    assert [m for m in kept if isinstance(m, bytes)] == [bytes([148]) * 2, bytes([49]) * 2, bytes([149]) * 2]
    assert [m for m in kept if isinstance(m, str)] == ["chunk 47", "chunk 48", "chunk 49", "end"]
    assert kept.index("chunk 49") < kept.index(bytes([149]) * 2) < kept.index("end")
    assert box.dropped == 150 + 1 - 7 and box.frames == 0 and not box.items


def test_a_page_opening_while_the_first_frames_are_shown_gets_them_once():
    """The session shows its first frames (from the sampling thread) while a page opens (on the server's
    loop) before the loop has run the showing: the page gets its hello, then each first frame once; a page
    opening later gets them too."""
    import asyncio

    from comfyui_fastar.nodes.play_routes import Live

    async def run():
        live = Live(Session(SPEC), {"type": "hello"}, asyncio.get_running_loop())
        shown = threading.Thread(target=live.show_first, args=([b"frame 0", b"frame 1"],))
        shown.start()
        shown.join()  # queued on the loop, not yet run
        early = live.open_page()
        await asyncio.sleep(0)  # the loop runs the showing
        late = live.open_page()
        return [[await box.get() for _ in range(len(box.items))] for box in (early, late)]

    early, late = asyncio.run(run())
    assert early == late == ['{"type": "hello", "paused": false}', b"frame 0", b"frame 1"]
