"""Action text is read in time linear in its length, within limits a message states: the Action Schedule's
check runs at queue time on ComfyUI's event loop and a live action on it too, so no text the limits admit
may hold the server. Each adversarial text (up to the limit) is read or refused within a hang guard of
1 s; a backtracking reader takes minutes on several of them."""
import time

import numpy as np
import pytest

from comfyui_fastar.fastar import FastARError
from comfyui_fastar.fastar.actions import ActionSpec, LOOK_ANY, MAX_FRAMES, MAX_LIVE_TEXT, MAX_TEXT, action_items, actions_text, parse_actions, used_names
from comfyui_fastar.fastar.play import Session
from comfyui_fastar.testing.action_text import adversarial

SPEC = ActionSpec()
L = MAX_TEXT


@pytest.mark.parametrize("name", sorted(adversarial()))
def test_adversarial_text_is_read_or_refused_at_once(name):
    text = adversarial()[name]
    assert len(text) == L
    for read in (lambda: parse_actions(text, SPEC, 12), lambda: used_names(text)):
        t0 = time.perf_counter()
        try:
            read()
        except FastARError as exc:
            assert len(str(exc)) < 300  # the message names a bounded piece of the text
        assert time.perf_counter() - t0 < 1.0, name  # a hang guard: a linear read takes milliseconds


def test_the_limits_are_enforced_and_stated():
    with pytest.raises(FastARError, match=f"is {L + 1} characters; at most {L} are read"):
        parse_actions("W," * (L // 2) + "W", SPEC, 12)
    with pytest.raises(FastARError, match=f"at most {L} are read"):
        used_names("[" + " " * L + "]")
    with pytest.raises(FastARError, match=f"at most {MAX_FRAMES} are played"):
        parse_actions(f"W*{MAX_FRAMES}f, D*1f", SPEC, 12)
    assert len(parse_actions(f"W*{MAX_FRAMES}f", SPEC, 12)) == MAX_FRAMES
    with pytest.raises(FastARError, match="more than 12 digits"):
        parse_actions("W*" + "9" * 13, SPEC, 12)
    s = Session(SPEC)
    with pytest.raises(FastARError, match=f"at most {MAX_LIVE_TEXT} are read"):
        s.post("W+" * 200 + "W")


@pytest.mark.parametrize("text, says", [
    ("W D", "'W D': a space inside a name"), ("W*2*3", "'W\\*2\\*3'"), ("D*4, !", "'!'"), ("look(1,2", "'look\\(1,2'"),
    ("W*1f, W*1x", "'W\\*1x'"), ("D*0", "^D\\*0 holds no frame$"), ("D*0f", "^D\\*0f holds no frame$"),
    (",,, ", "no action"), ('[["D", 1e400]]', "JSON"), ('[["W D", 1]]', "a space inside"),
])
def test_unreadable_text_is_named_as_typed(text, says):
    with pytest.raises(FastARError, match=says):
        parse_actions(text, SPEC, 12)


@pytest.mark.parametrize("text", ["look(1" + "0" * 40 + ",0)", "look(0.13,0)", "look(0,-0.2)", "look_left+look(0,-0.05)"])
def test_the_mouse_beyond_the_worlds_range_is_refused_by_name(text):
    with pytest.raises(FastARError, match="trained within ±0.12 on each axis"):
        parse_actions(text, SPEC, 12)
    with pytest.raises(FastARError, match="trained within"):
        Session(SPEC).post(text)
    mg = ActionSpec(keys=("W", "S", "A", "D"), mouse_limit=0.1)
    with pytest.raises(FastARError, match="trained within ±0.1 on each axis"):
        parse_actions("look(0.11,0)", mg, 12)


def test_a_log_of_any_readable_rows_reads_back_exactly_in_short_decimals():
    rng = np.random.default_rng(0)
    rows = np.zeros((200, SPEC.width), np.float32)
    rows[:, :len(SPEC.keys)] = rng.random((200, len(SPEC.keys))) < 0.3
    rows[:, len(SPEC.keys):] = rng.uniform(-0.12, 0.12, (200, 2)).astype(np.float32)
    text = actions_text(rows, SPEC)
    assert np.array_equal(parse_actions(text, SPEC, 12), rows)
    numbers = [n for t in text.split("look(")[1:] for n in t.split(")")[0].split(",")]
    assert numbers and max(len(n) for n in numbers) <= 13  # float32's 9 digits at most, not float64's 17


def test_used_names_are_what_the_items_hold():
    text = "W+D*2f, look(0.01, -0.02)*3, idle*1.5s, Zoom_In"
    assert used_names(text) == {"W", "D", LOOK_ANY, "idle", "Zoom_In"}
    assert used_names('[["W+D", 2], ["jump", 1]]') == {"W", "D", "jump"}
    assert {n for k, _, _ in action_items(text) for n in k.split("+")} - {"look(0.01,-0.02)"} \
        == used_names(text) - {LOOK_ANY}
