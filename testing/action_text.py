"""Action text built to make a backtracking reader try every split, at the limit: what the parser's tests
and its benchmark read."""
from __future__ import annotations

from ..fastar.actions import MAX_TEXT as L


def adversarial() -> dict[str, str]:
    """Texts of exactly ``MAX_TEXT`` characters built to make a backtracking reader try every split."""
    texts = {
        "spaces": "W" + " " * (L - 2) + "!", "spaces_inside": "W*" + " " * (L - 3) + "x",
        "plus": "W" + "+" * (L - 1), "letters": "a" * L, "letters_then_bad": "a" * (L - 1) + "!",
        "letters_and_spaces": "W " * (L // 2), "spaced_plus": "W +" * (L // 3), "unclosed_look": "look(" * (L // 5),
        "unclosed_looks": "look(0.1," * (L // 9), "commas": "," * L, "paren_commas": "(" + "," * (L - 1),
        "digits": "W*" + "1" * (L - 2), "dots": "W*" + "." * (L - 2), "nested_counts": "W*2*3, " * (L // 7),
        "items": "W," * (L // 2), "looks": "look(0.1,0.1)," * (L // 14), "signs": "look(" + "-" * (L - 6) + ")",
        "every_token": "W+D*2f, look(0.01,-0.02)*3, idle*1.5s, zoom_in*1, " * (L // 48),
        "bad_last": "W*1f," * (L // 5 - 1) + "W*1x",
    }
    return {k: (t * 2)[:L] if len(t) < L else t[:L] for k, t in texts.items()}
