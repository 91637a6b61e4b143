"""The hot-expert cache's bookkeeping (models/expert_cache.py): splits, LRU eviction, admission
after N misses, the slots' bytes equal to the host experts', and the plan's bytes as slots."""
import pytest
import torch

from models.expert_cache import ExpertCache
from models.formats import ExpertBank

Q8_0 = 8  # ggml type: 34 bytes a 32-value block


def _bank(E, out, k, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (E, out, k // 32 * 34), dtype=torch.uint8, generator=g)
    return ExpertBank(raw, Q8_0, (E, out, k))


@pytest.fixture
def banks():
    # two MoE layers, 7 experts each: gate_up [7, 10, 64] and down [7, 64, 32] (odd sizes)
    return {3: [_bank(7, 10, 64, 1), _bank(7, 64, 32, 2)], 5: [_bank(7, 10, 64, 3), _bank(7, 64, 32, 4)]}


def test_a_cold_cache_misses_then_serves_the_copied_experts_bit_for_bit(banks):
    c = ExpertCache(banks, 3)
    ids = torch.tensor([[4, 1], [1, 6]])
    hit, _ = c.split(3, ids)
    assert not hit.any() and c.admit(3, ids, hit) == [1, 4, 6]
    hit, slot = c.split(3, torch.tensor([[6, 2], [1, 4]]))
    assert hit.tolist() == [[True, False], [True, True]]
    for e, s in ((6, slot[0, 0]), (1, slot[1, 0]), (4, slot[1, 1])):
        for j in range(2):
            assert torch.equal(c.bank(3, j)[int(s)].raw, banks[3][j][e].raw)
            torch.testing.assert_close(c.bank(3, j)[int(s)].dense(), banks[3][j][e].dense(), rtol=0, atol=0,
                                       equal_nan=True)  # random block scales: some are NaN
    assert (c.stats.lookups, c.stats.hits) == (8, 3) and c.stats.hit_rate == 3 / 8
    assert c.stats.per_layer == {3: [8, 3]}


def test_the_least_recently_used_expert_makes_room(banks):
    c = ExpertCache(banks, 2)
    for e in (0, 1):
        ids = torch.tensor([[e]])
        c.admit(5, ids, c.split(5, ids)[0])
    c.split(5, torch.tensor([[0]]))  # 0 used again: 1 is now the least recent
    ids = torch.tensor([[2]])
    c.admit(5, ids, c.split(5, ids)[0])
    assert sorted(c.cached(5)) == [0, 2] and c.cached(3) == {}


def test_admission_after_n_misses_keeps_one_off_picks_out(banks):
    c = ExpertCache(banks, 2, admit_after=2)
    ids = torch.tensor([[3, 5]])
    assert c.admit(3, ids, c.split(3, ids)[0]) == []
    assert c.admit(3, torch.tensor([[3]]), c.split(3, torch.tensor([[3]]))[0]) == [3]
    assert c.cached(3) == {3: 0}


def test_slots_never_exceed_the_experts_and_plan_bytes_become_slots(banks):
    assert ExpertCache(banks, 50).slots == 7
    assert ExpertCache(banks, 0).layers == {} and not ExpertCache(banks, 0).covers(3)
    assert ExpertCache.slots_for(10 * 4096 + 4095, 4096, 3) == 3
    with pytest.raises(ValueError):
        ExpertCache(banks, -1)
