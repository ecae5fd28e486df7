"""TempCache's group merge: the twin makes each merged slot the mean of its group (old mean
weighted by its count) with the newest member's key and leaves other rows alone; the Triton
kernel equals the twin."""
import pytest
import torch

from comfyui_fastar.kernels.merge_rows import merge_rows, merge_rows_auto, merge_rows_torch


def _case(seed, dtype, m=20, n=45, h=3, d=16, device="cpu"):
    """History rows as a strided slice; ~half the tokens merge, several into one slot; the group
    state (count, added, rep) as TempCache derives it."""
    g = torch.Generator().manual_seed(seed)
    buf_k, buf_v = (torch.randn(m + 6, h + 1, d, generator=g).to(device, dtype) for _ in range(2))
    new_k, new_v = (torch.randn(h, n, d, generator=g).to(dtype).transpose(0, 1) for _ in range(2))
    slot = torch.randint(0, m // 2, (h, n), generator=g)          # crowded: groups of several tokens
    count = torch.randint(0, 4, (h, m), generator=g).float()
    merge = (torch.rand(h, n, generator=g) < 0.5) & (count.gather(1, slot) > 0)
    added = torch.zeros(h, m).scatter_add_(1, slot, merge.float())
    rep = torch.full((h, m), -1).scatter_reduce_(1, slot, torch.where(merge, torch.arange(n), -1), "amax")
    k, v = buf_k[3:m + 3, :h], buf_v[3:m + 3, :h]
    return (buf_k, buf_v, k, v, *(t.to(device) for t in (new_k, new_v, slot, merge, count, added, rep)))


def test_twin_averages_each_group_and_keeps_the_newest_key():
    buf_k, buf_v, k, v, new_k, new_v, slot, merge, count, added, rep = _case(0, torch.float64)
    want_k, want_v = buf_k.clone(), buf_v.clone()
    groups = 0
    for h in range(3):
        for s in range(20):
            members = [i for i in range(45) if merge[h, i] and slot[h, i] == s]
            if not members:
                continue
            groups += len(members) > 1
            c = count[h, s].item()
            want_v[s + 3, h] = (c * buf_v[s + 3, h] + sum(new_v[i, h] for i in members)) / (c + len(members))
            want_k[s + 3, h] = new_k[max(members), h]
    assert groups > 3  # groups of several tokens are exercised
    merge_rows_torch(k, v, new_k, new_v, slot, merge, count, added, rep)
    torch.testing.assert_close(buf_v, want_v, rtol=1e-5, atol=1e-6)  # summed in fp32
    assert torch.equal(buf_k, want_k)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
def test_kernel_equals_twin(dtype, tol, device):
    case = _case(1, dtype, device=device)
    twin = [t.clone() if torch.is_tensor(t) else t for t in case]
    # the views of the clones' buffers, then the same inputs
    twin[2], twin[3] = twin[0][3:23, :3], twin[1][3:23, :3]
    merge_rows(*case[2:])
    merge_rows_torch(*twin[2:])
    assert torch.equal(case[0], twin[0])  # keys: copies
    torch.testing.assert_close(case[1], twin[1], rtol=tol, atol=tol)
    untouched = torch.ones(26, 4, dtype=torch.bool, device=device)
    untouched[3:23, :3] = (case[9] == 0).t()
    assert torch.equal(case[1][untouched], _case(1, dtype, device=device)[1][untouched])  # rows no token merges into


def test_auto_takes_the_twin_for_bf16_under_the_interpreter(monkeypatch):
    """Triton's CPU interpreter has no bf16 atomics: the dispatcher must not pick the kernel there
    (a kernel picked on CPU tensors would fail, interpreted or not)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = _case(2, torch.bfloat16)
    twin = [t.clone() if torch.is_tensor(t) else t for t in case]
    twin[2], twin[3] = twin[0][3:23, :3], twin[1][3:23, :3]
    merge_rows_auto(*case[2:])
    merge_rows_torch(*twin[2:])
    assert torch.equal(case[1], twin[1]) and torch.equal(case[0], twin[0])


def test_bad_calls_name_the_problem():
    _, _, k, v, new_k, new_v, slot, merge, count, added, rep = _case(3, torch.float32)
    with pytest.raises(ValueError, match="slot must be torch.int64"):
        merge_rows_torch(k, v, new_k, new_v, slot.int(), merge, count, added, rep)
    with pytest.raises(ValueError, match="count must be torch.float32"):
        merge_rows_torch(k, v, new_k, new_v, slot, merge, count[:, :5], added, rep)
    with pytest.raises(ValueError, match="share a dtype"):
        merge_rows_torch(k, v.double(), new_k, new_v, slot, merge, count, added, rep)


@pytest.mark.cuda
def test_kernel_equals_twin_in_bf16_at_the_chunk_shape(device):
    """bf16 (atomic adds need the GPU) at Wan 1.3B's shapes, groups of up to ~4 tokens per slot: the
    representative's row in fp32 then the others' shares added in bf16 stay within bf16 rounding
    of the fp32 twin."""
    chunk = device.chunk
    g = torch.Generator(device=device).manual_seed(9)
    m, n, h, d = 18 * chunk.frame_tokens, chunk.tokens, chunk.heads, chunk.head_dim
    k, v = (torch.randn(m, h, d, device=device, generator=g).bfloat16() for _ in range(2))
    new_k, new_v = (torch.randn(n, h, d, device=device, generator=g).bfloat16() for _ in range(2))
    slot = torch.randint(0, 2000, (h, n), device=device, generator=g)
    count = torch.randint(0, 5, (h, m), device=device, generator=g).float()
    merge = (torch.rand(h, n, device=device, generator=g) < 0.6) & (count.gather(1, slot) > 0)
    added = torch.zeros(h, m, device=device).scatter_add_(1, slot, merge.float())
    token = torch.arange(n, device=device)
    rep = torch.full((h, m), -1, device=device).scatter_reduce_(1, slot, torch.where(merge, token, -1), "amax")
    assert added.max().item() >= 3
    k2, v2 = k.clone(), v.clone()
    merge_rows(k, v, new_k, new_v, slot, merge, count, added, rep)
    merge_rows_torch(k2, v2, new_k, new_v, slot, merge, count, added, rep)
    assert torch.equal(k, k2)
    torch.testing.assert_close(v, v2, rtol=2e-2, atol=2e-2)
    assert ((v.float() - v2.float()).norm() / v2.float().norm()).item() < 3e-3
