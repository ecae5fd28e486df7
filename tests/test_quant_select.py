"""AnnSA 'quant' selection (scores -> key ranges): twin vs brute force, Triton kernel vs twin (CPU interpreter).

The flag must be set before anything imports triton.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from comfyui_fastar.kernels import HAS_TRITON  # noqa: E402
from comfyui_fastar.kernels.quant_select import quant_select, quant_select_torch  # noqa: E402

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not importable")
NEG_INF = float("-inf")


def _case(gen, b, h, nqb, nkb, ties):
    """Scores with many ties (small integers) or few (Gaussian), some -inf and -0.0, and empty blocks."""
    if ties:
        score = torch.randint(-3, 4, (b, h, nqb, nkb), generator=gen).float()
        score[score == 0] = torch.where(torch.rand(int((score == 0).sum()), generator=gen) < 0.5, -0.0, 0.0)
    else:
        score = torch.randn(b, h, nqb, nkb, generator=gen)
    score[torch.rand(b, h, nqb, nkb, generator=gen) < 0.15] = NEG_INF
    held = torch.rand(b, h, nkb, generator=gen) > 0.2
    return score, held


def _brute(score, held, top, key_block, rows_start, rows_stop, sink, chunk_start, chunk_stop):
    """Row by row in Python: rank by (score desc, index asc), runs of picked blocks that hold keys."""
    b, h, nqb, nkb = score.shape
    ranges = torch.zeros(b, h, nqb, 2 + top, 2, dtype=torch.int32)
    counts = torch.zeros(b, h, nqb, dtype=torch.int32)
    for bi in range(b):
        for hi in range(h):
            for i in range(nqb):
                row = score[bi, hi, i].tolist()
                picked = sorted(sorted(range(nkb), key=lambda j: (-row[j], j))[:top])
                runs = []
                for j in picked:
                    if not held[bi, hi, j]:
                        continue
                    if runs and runs[-1][1] == j - 1:
                        runs[-1][1] = j
                    else:
                        runs.append([j, j])
                slots = [(0, sink), (chunk_start, chunk_stop)] + [
                    (rows_start + f * key_block, min(rows_start + (last + 1) * key_block, rows_stop))
                    for f, last in runs]
                ranges[bi, hi, i, :len(slots)] = torch.tensor(slots, dtype=torch.int32)
                counts[bi, hi, i] = len(slots)
    return ranges, counts


def _fixed(nkb, key_block=64):
    rows_start = 3 * key_block + 5
    return dict(key_block=key_block, rows_start=rows_start, rows_stop=rows_start + nkb * key_block - 17, sink=7,
                chunk_start=rows_start + nkb * key_block, chunk_stop=rows_start + nkb * key_block + 40)


@pytest.mark.parametrize("ties", [True, False])
def test_twin_matches_brute_force(ties):
    gen = torch.Generator().manual_seed(1 + ties)
    for nkb, top in ((1, 1), (9, 4), (40, 40), (33, 1), (50, 17)):
        score, held = _case(gen, 1, 2, 3, nkb, ties)
        kw = _fixed(nkb)
        got = quant_select_torch(score, held, top, **kw)
        want = _brute(score, held, top, **kw)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (nkb, top)


@needs_triton
@pytest.mark.parametrize("ties", [True, False])
def test_kernel_equals_twin_on_random_rows(ties):
    """Rows streamed in chunks shorter than the row (runs and ties crossing chunk edges) and rows
    held whole (the default chunk), every top."""
    gen = torch.Generator().manual_seed(10 + ties)
    for case in range(8):
        nkb = int(torch.randint(1, 70, (1,), generator=gen))
        top = int(torch.randint(1, nkb + 1, (1,), generator=gen))
        score, held = _case(gen, 2, 2, 3, nkb, ties)
        kw = _fixed(nkb, key_block=[64, 128][case % 2])
        want = quant_select_torch(score, held, top, **kw)
        for chunk in (16, None):
            got = quant_select(score, held, top, chunk=chunk, **kw)
            assert torch.equal(got[1], want[1]), (case, nkb, top, chunk)
            assert torch.equal(got[0], want[0]), (case, nkb, top, chunk)


@needs_triton
def test_kernel_every_block_picked_is_one_run():
    score, held = torch.zeros(1, 1, 2, 37), torch.ones(1, 1, 37, dtype=torch.bool)
    kw = _fixed(37)
    ranges, counts = quant_select(score, held, 37, chunk=16, **kw)
    assert counts.tolist() == [[[3, 3]]]
    assert ranges[0, 0, 0, 2].tolist() == [kw["rows_start"], kw["rows_stop"]]


def test_bad_inputs_raise():
    score, held = torch.zeros(1, 1, 2, 8), torch.ones(1, 1, 8, dtype=torch.bool)
    kw = _fixed(8)
    for bad, match in ((dict(top=0), "top"), (dict(top=9), "top"), (dict(held=held[..., :7]), "held"),
                       (dict(score=score.double()), "score")):
        args = {"score": score, "held": held, "top": 4, **bad}
        with pytest.raises(ValueError, match=match):
            quant_select_torch(args["score"], args["held"], args["top"], **kw)
