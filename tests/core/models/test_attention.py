"""The exact target's attention: a row of a verification pass, chain or tree, is computed as the one-token step
that reads the same keys computes it, bit for bit, at any context length."""
import pytest
import torch

from specdec_core.cache import TreeInput
from specdec_core.models import attention
from specdec_core.models.attention import BLOCK, row_attention, widened

HKV, D, N = 2, 128, 17
QWEN, TINY = 6, 2  # query heads per key/value head: Qwen2.5-Coder 1.5B's (2 of 6, 128 wide), and the tiny pair's


def cache_with_room(s: int, room: int, fill: float):
    """Keys and values of `s` positions, views of buffers `room` positions longer, filled past `s` with `fill`:
    a grown cache's room holds stale entries of rolled-back tokens, or zeros."""
    k, v = (torch.full((1, HKV, s + room, D), fill) for _ in range(2))
    k[:, :, :s], v[:, :, :s] = torch.randn(1, HKV, s, D), torch.randn(1, HKV, s, D)
    return k[:, :, :s], v[:, :, :s]


def step(query, key, value, row: int, seen) -> torch.Tensor:
    """Row `row` of `query` as a one-token step computes it: its keys are the cache up to `seen` (a count), or the
    given positions in order, laid out as a cache of exactly those entries."""
    if not isinstance(seen, int):
        key, value, seen = key.index_select(2, seen), value.index_select(2, seen), len(seen)
    return row_attention(None, query[:, :, row: row + 1], key[:, :, :seen], value[:, :, :seen], None)[0][0, 0]


@pytest.fixture()
def calls(monkeypatch):
    """Per call of the one kernel behind every row: its number of rows, the width of its key range, and whether
    the rows read keys gathered for each (a tree node's) rather than one range of the cache."""
    for g in (QWEN, TINY):  # probed before the recording starts (attention.rows_agree)
        attention.rows_agree(HKV, g, D, torch.device("cpu"), torch.float32)
    seen, attend = [], attention.attend
    monkeypatch.setattr(attention, "attend", lambda q, k, *a: seen.append((q.shape[1], k.shape[-2], k.dim() == 4))
                        or attend(q, k, *a))
    return seen


@pytest.mark.parametrize("context", [1, 40, 47, 48, 63, 64, 100, 500, 1000])
@pytest.mark.parametrize("room", [0, 100])
@pytest.mark.parametrize("g", [QWEN, TINY])  # 2: a step's product has too few rows for MKL's usual kernel
def test_a_chain_pass_rows_equal_steps(context, room, g, calls):
    torch.manual_seed(context)
    s = context + N
    key, value = cache_with_room(s, room, fill=1e4)  # finite stale entries past the cache carry no weight
    query = torch.randn(1, HKV * g, N, D)
    out = row_attention(None, query, key, value, None)[0]
    row_widths = [-(-(context + i + 1) // BLOCK) * BLOCK for i in range(N)]
    widths = sorted(set(row_widths))
    assert len(widths) == 1 + (context % BLOCK > BLOCK - N)
    if attention.rows_agree(HKV, g, D, torch.device("cpu"), torch.float32):  # rows batched, a call per key width
        assert calls == [(row_widths.count(w), w, False) for w in widths]
    else:  # this CPU's MKL sums a batched row otherwise (seen for g = 2 on a Xeon): a product per row, as a step's
        assert calls == [(1, w, False) for w in row_widths]
    for i in range(N):
        assert torch.equal(out[0, i], step(query, key, value, i, context + i + 1)), i
    # past the cache the rows read the buffer's room where there is some, else zeros
    assert (widened(key, widths[-1]).data_ptr() == key.data_ptr()) == (s + room >= widths[-1])


@pytest.mark.parametrize("context", [5, 60, 1000])
@pytest.mark.parametrize("g", [QWEN, TINY])
def test_a_tree_pass_rows_equal_steps_over_their_ancestors(context, g, calls):
    torch.manual_seed(context)
    parents = [-1, -1, 0, 0, 1, 2, 2, 3, 5, 5, 6, 8, 8, 10, 11, 12, 13]  # 17 nodes, depths 1 to 7
    s = context + len(parents)
    key, value = cache_with_room(s, 0, fill=0.0)
    query = torch.randn(1, HKV * g, len(parents), D)
    mask = TreeInput(parents).model_inputs(context, "sdpa", "cpu")["attention_mask"]
    out = row_attention(None, query, key, value, mask)[0]
    sees = mask[0, 0]
    assert sum(rows for rows, _, _ in calls) == len(parents)
    assert {gathered for _, _, gathered in calls} == {False, True}  # node 0 reads a range, node 1 skips node 0
    for i in range(len(parents)):
        seen = sees[i].nonzero()[:, 0]
        assert len(seen) > context + 1 or parents[i] < 0
        assert torch.equal(out[0, i], step(query, key, value, i, seen)), i


def test_where_a_product_s_rows_depend_on_their_number_each_row_gets_a_step_s_product(monkeypatch, calls):
    """Batching a pass's rows relies on the matrix products giving a row the same bits whatever number of rows they
    hold. MKL does here from 4 rows up; another CPU's library may not. Such a library is probed, and every row then
    gets a product of its own, shaped as a step's."""
    real = torch.bmm

    def bmm(a, b):  # sums that change with the number of rows in the product, as MKL's do below 4 rows
        out = real(a, b)
        return out + out * (a.shape[1] * 2.0 ** -20)

    monkeypatch.setattr(torch, "bmm", bmm)
    monkeypatch.setattr(attention, "_agrees", {})
    torch.manual_seed(0)
    context = 100
    key, value = cache_with_room(context + N, 50, fill=0.0)
    query = torch.randn(1, HKV * QWEN, N, D)
    out = row_attention(None, query, key, value, None)[0]
    assert attention._agrees == {("cpu", torch.float32, HKV, QWEN, D): False}
    assert [rows for rows, _, _ in calls][-N:] == [1] * N  # after the probe's calls, a call per row
    for i in range(N):
        assert torch.equal(out[0, i], step(query, key, value, i, context + i + 1)), i
