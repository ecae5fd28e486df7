"""AnnSA 'quant' selection (scores -> key ranges): twin vs brute force, Triton kernel vs twin."""

import math

import pytest
import torch

from comfyui_fastar.kernels.plan import range_reads
from comfyui_fastar.kernels.quant_select import quant_select, quant_select_torch, slots

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


def _brute(score, held, top, key_block, rows_start, rows_stop, sink, chunk_start, chunk_stop, mass=None, fixed=None):
    """Row by row in Python: rank by (score desc, index asc) and pick the first ``top``; with
    ``mass`` (in float64) also the fewest best held blocks, with every tie of the last, whose
    weights exp(score) reach ``mass`` of the row's total with exp(fixed); then runs of picked
    blocks that hold keys."""
    b, h, nqb, nkb = score.shape
    ranges = torch.zeros(b, h, nqb, 2 + slots(top, nkb, mass), 2, dtype=torch.int32)
    counts = torch.zeros(b, h, nqb, dtype=torch.int32)
    for bi in range(b):
        for hi in range(h):
            for i in range(nqb):
                row = score[bi, hi, i].tolist()
                picked = sorted(sorted(range(nkb), key=lambda j: (-row[j], j))[:top])
                if mass is not None:
                    mine = _mass_pick(row, [j for j in range(nkb) if held[bi, hi, j]], mass, float(fixed[bi, hi, i]))
                    picked = sorted(set(picked) | set(mine))
                runs = []
                for j in picked:
                    if not held[bi, hi, j]:
                        continue
                    if runs and runs[-1][1] == j - 1:
                        runs[-1][1] = j
                    else:
                        runs.append([j, j])
                spans = [(0, sink), (chunk_start, chunk_stop)] + [
                    (rows_start + f * key_block, min(rows_start + (last + 1) * key_block, rows_stop))
                    for f, last in runs]
                ranges[bi, hi, i, :len(spans)] = torch.tensor(spans, dtype=torch.int32)
                counts[bi, hi, i] = len(spans)
    return ranges, counts


def _mass_pick(row, cand, mass, fixed):
    """The blocks a row picks by mass (sorted; [] when it needs nothing)."""
    top_s = max([fixed] + [row[j] for j in cand])
    w = {j: math.exp(row[j] - top_s) for j in cand}
    e_f = math.exp(fixed - top_s)
    if mass >= 1:
        return list(cand)
    need = mass * (e_f + sum(w.values())) - e_f
    if need <= 0:
        return []
    got = 0.0
    for j in sorted(cand, key=lambda j: -row[j]):
        got, t = got + w[j], row[j]
        if got >= need:
            break
    return [j for j in cand if row[j] >= t]


def _fixed(nkb, key_block=64):
    rows_start = 3 * key_block + 5
    return dict(key_block=key_block, rows_start=rows_start, rows_stop=rows_start + nkb * key_block - 17, sink=7,
                chunk_start=rows_start + nkb * key_block, chunk_stop=rows_start + nkb * key_block + 40)


def test_range_reads_and_the_twins_reads():
    """Keys read are the used ranges' lengths summed; the twin writes them into ``reads`` when given one."""
    ranges = torch.tensor([[[[[0, 7], [20, 60], [100, 164], [5, 9]], [[0, 0], [20, 60], [9, 3], [0, 0]]]]],
                          dtype=torch.int32)
    assert range_reads(ranges, torch.tensor([[[3, 3]]], dtype=torch.int32)).tolist() == [[[111, 40]]]
    gen = torch.Generator().manual_seed(5)
    score, held = _case(gen, 1, 2, 3, 21, False)
    kw = _fixed(21)
    reads = torch.zeros(1, 2, 3, dtype=torch.int32)
    ranges, counts = quant_select_torch(score, held, 6, reads=reads, **kw)
    want = _brute(score, held, 6, **kw)
    assert torch.equal(reads, range_reads(*want))
    for bad in (torch.zeros(1, 2, 4, dtype=torch.int32), torch.zeros(1, 2, 3), torch.zeros(1, 3, 2, dtype=torch.int32).mT):
        with pytest.raises(ValueError, match="reads"):
            quant_select_torch(score, held, 6, reads=bad, **kw)


@pytest.mark.parametrize("ties", [True, False])
def test_twin_matches_brute_force(ties):
    gen = torch.Generator().manual_seed(1 + ties)
    for nkb, top in ((1, 1), (9, 4), (40, 40), (33, 1), (50, 17)):
        score, held = _case(gen, 1, 2, 3, nkb, ties)
        kw = _fixed(nkb)
        got = quant_select_torch(score, held, top, **kw)
        want = _brute(score, held, top, **kw)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (nkb, top)


@pytest.mark.parametrize("ties", [True, False])
def test_kernel_equals_twin_on_random_rows(ties, device):
    """Rows streamed in chunks shorter than the row (runs and ties crossing chunk edges) and rows
    held whole (the default chunk), every top."""
    gen = torch.Generator().manual_seed(10 + ties)
    for case in range(8):
        nkb = int(torch.randint(1, 70, (1,), generator=gen))
        top = int(torch.randint(1, nkb + 1, (1,), generator=gen))
        # two batches or two heads: each stride is walked, at a third of the interpreter's time of both
        score, held = (t.to(device) for t in _case(gen, *((2, 1, 2), (1, 2, 2))[case // 2 % 2], nkb, ties))
        kw = _fixed(nkb, key_block=[64, 128][case % 2])
        want = quant_select_torch(score, held, top, **kw)
        for chunk in (16, None):
            reads = torch.full(want[1].shape, -1, dtype=torch.int32, device=device)
            got = quant_select(score, held, top, chunk=chunk, reads=reads, **kw)
            assert torch.equal(got[1], want[1]), (case, nkb, top, chunk)
            assert torch.equal(got[0], want[0]), (case, nkb, top, chunk)
            assert torch.equal(reads, range_reads(*want)), (case, nkb, top, chunk)


def _mass_case(gen, b, h, nqb, nkb, ties):
    score, held = _case(gen, b, h, nqb, nkb, ties)
    fixed = torch.randn(b, h, nqb, generator=gen) + 1.0
    return score, held, fixed


@pytest.mark.parametrize("ties", [True, False])
def test_mass_twin_matches_brute_force(ties):
    gen = torch.Generator().manual_seed(3 + ties)
    for nkb, top, mass in ((1, 1, 0.93), (9, 4, 0.81), (40, 40, 0.97), (33, 3, 0.93), (50, 17, 0.37), (12, 12, 0.0),
                           (12, 5, 1.0)):
        score, held, fixed = _mass_case(gen, 1, 2, 3, nkb, ties)
        kw = _fixed(nkb)
        got = quant_select_torch(score, held, top, mass=mass, fixed=fixed, **kw)
        want = _brute(score, held, top, mass=mass, fixed=fixed, **kw)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (nkb, top, mass)


def test_mass_reads_fewer_blocks_where_the_fixed_keys_hold_the_mass():
    """A row whose sink and own chunk carry 97% of the mass reads only its top block at 0.93; a
    diffuse row the best 19 of 20 nearly equal blocks; mass 1 every block."""
    nkb = 20
    score = (-1e-3 * torch.arange(nkb)).expand(1, 1, 2, nkb).contiguous()
    held = torch.ones(1, 1, nkb, dtype=torch.bool)
    fixed = torch.tensor([[[math.log(0.97 / 0.03 * nkb), -30.0]]])
    kw = _fixed(nkb)
    ranges, counts = quant_select_torch(score, held, 1, mass=0.93, fixed=fixed, **kw)
    assert counts.tolist() == [[[3, 3]]]
    assert ranges[0, 0, 0, 2].tolist() == [kw["rows_start"], kw["rows_start"] + 64]
    assert ranges[0, 0, 1, 2].tolist() == [kw["rows_start"], kw["rows_start"] + 19 * 64]
    ranges, counts = quant_select_torch(score, held, 1, mass=1.0, fixed=fixed, **kw)
    assert ranges[0, 0, :, 2].tolist() == [[kw["rows_start"], kw["rows_stop"]]] * 2


@pytest.mark.parametrize("ties", [True, False])
def test_mass_kernel_equals_twin_on_random_rows(ties, device):
    gen = torch.Generator().manual_seed(20 + ties)
    for case, mass in enumerate((0.93, 0.5, 0.0, 1.0, 0.8, 0.99)):
        nkb = int(torch.randint(1, 70, (1,), generator=gen))
        top = int(torch.randint(1, nkb + 1, (1,), generator=gen))
        score, held, fixed = (t.to(device) for t in _mass_case(gen, 1, 2, 2, nkb, ties))
        kw = _fixed(nkb, key_block=[64, 128][case % 2])
        want = quant_select_torch(score, held, top, mass=mass, fixed=fixed, **kw)
        for chunk in (16, None):
            reads = torch.full(want[1].shape, -1, dtype=torch.int32, device=device)
            got = quant_select(score, held, top, mass=mass, fixed=fixed, chunk=chunk, reads=reads, **kw)
            assert torch.equal(got[1], want[1]), (case, nkb, top, chunk)
            assert torch.equal(got[0], want[0]), (case, nkb, top, chunk)
            assert torch.equal(reads, range_reads(*want)), (case, nkb, top, chunk)


def test_kernel_every_block_picked_is_one_run(device):
    score, held = torch.zeros(1, 1, 2, 37, device=device), torch.ones(1, 1, 37, dtype=torch.bool, device=device)
    kw = _fixed(37)
    ranges, counts = quant_select(score, held, 37, chunk=16, **kw)
    assert counts.tolist() == [[[3, 3]]]
    assert ranges[0, 0, 0, 2].tolist() == [kw["rows_start"], kw["rows_stop"]]


def test_bad_inputs_raise():
    score, held = torch.zeros(1, 1, 2, 8), torch.ones(1, 1, 8, dtype=torch.bool)
    kw = _fixed(8)
    fixed = torch.zeros(1, 1, 2)
    for bad, match in ((dict(top=0), "top"), (dict(top=9), "top"), (dict(held=held[..., :7]), "held"),
                       (dict(score=score.double()), "score"), (dict(mass=1.5, fixed=fixed), "mass"),
                       (dict(mass=0.9), "fixed"), (dict(mass=0.9, fixed=fixed[..., :1]), "fixed")):
        args = {"score": score, "held": held, "top": 4, **bad}
        with pytest.raises(ValueError, match=match):
            quant_select_torch(args.pop("score"), args.pop("held"), args.pop("top"), **args, **kw)
