"""Pipeline schedules against their definitions, written out here by hand."""

import pytest

from stg.errors import PlanError
from stg.schedule import SPLIT_BACKWARD, Action, Kind, grid, make_schedule, peak_in_flight, simulate

F, B, W = Kind.F, Kind.B, Kind.W
CASES = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]


def full_backward(i, chunk=0):
    return [Action(i, B, chunk), Action(i, W, chunk)]


@pytest.mark.parametrize("p, m", CASES)
def test_gpipe_is_all_forwards_then_all_backwards(p, m):
    expected = [Action(i, F) for i in range(m)] + [a for i in range(m) for a in full_backward(i)]
    assert make_schedule("gpipe", p, m) == [expected] * p


@pytest.mark.parametrize("p, m", CASES)
def test_1f1b_warms_up_with_p_minus_rank_minus_1_forwards(p, m):
    """PipeDream-Flush: warm-up of p - r - 1 forwards, then one forward and one backward,
    then the remaining backwards."""
    schedule = make_schedule("1f1b", p, m)
    for r in range(p):
        warmup = p - r - 1
        expected = [Action(i, F) for i in range(warmup)]
        for i in range(m - warmup):
            expected += [Action(warmup + i, F), *full_backward(i)]
        for i in range(m - warmup, m):
            expected += full_backward(i)
        assert schedule[r] == expected, r


def test_1f1b_by_hand_p4_m8_first_and_last_stage():
    schedule = make_schedule("1f1b", 4, 8)
    assert " ".join(map(str, schedule[0])) == (
        "0F0 1F0 2F0 3F0 0B0 0W0 4F0 1B0 1W0 5F0 2B0 2W0 6F0 3B0 3W0 7F0 4B0 4W0 5B0 5W0 6B0 6W0 7B0 7W0")
    assert " ".join(map(str, schedule[3])) == (
        "0F0 0B0 0W0 1F0 1B0 1W0 2F0 2B0 2W0 3F0 3B0 3W0 4F0 4B0 4W0 5F0 5B0 5W0 6F0 6B0 6W0 7F0 7B0 7W0")


def test_interleaved_follows_megatron_p4_v2_m8():
    """Megatron-LM's forward_backward_pipelining_with_interleaving: warm-up
    2(p - r - 1) + (v - 1)p virtual micro-batches; virtual micro-batch k is chunk
    (k mod pv) div p (counted from the last chunk for backwards) of micro-batch
    (k div pv) p + k mod p. Stage 0: 10 warm-up forwards; stage 3: 4."""
    schedule = make_schedule("interleaved", 4, 8, 2)
    stage0 = ("0F0 1F0 2F0 3F0 0F1 1F1 2F1 3F1 4F0 5F0 "  # k = 0..9
              "6F0 0B1 7F0 1B1 4F1 2B1 5F1 3B1 6F1 0B0 7F1 1B0 "  # steady: F(k+10), B(k)
              "2B0 3B0 4B1 5B1 6B1 7B1 4B0 5B0 6B0 7B0")  # cool-down
    stage3 = ("0F0 1F0 2F0 3F0 "
              "0F1 0B1 1F1 1B1 2F1 2B1 3F1 3B1 4F0 0B0 5F0 1B0 6F0 2B0 7F0 3B0 "
              "4F1 4B1 5F1 5B1 6F1 6B1 7F1 7B1 4B0 5B0 6B0 7B0")
    for rank, text in ((0, stage0), (3, stage3)):
        expected = []
        for token in text.split():
            action = Action.parse(token)
            expected += [action] if action.kind is F else full_backward(action.microbatch, action.chunk)
        assert schedule[rank] == expected, rank


def test_actions_print_and_parse():
    assert str(Action(3, F, 1)) == "3F1"
    assert Action.parse("12W0") == Action(12, W, 0)
    with pytest.raises(ValueError):
        Action.parse("3X1")


UNIT = dict(F=1.0, B=1.0, W=1.0)


@pytest.mark.parametrize("p, m", CASES)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_unit_cost_makespan_of_gpipe_and_1f1b(name, p, m):
    makespan, _ = simulate(make_schedule(name, p, m), lambda a: UNIT[a.kind.value])
    assert makespan == (m + p - 1) * 3  # (m + p - 1)(F + B + W)


@pytest.mark.parametrize("p, m", [(p, m) for p, m in CASES])
def test_interleaved_bubble_is_p_minus_1_over_vm(p, m):
    v = 2
    # each chunk holds 1/v of a stage's layers: F = B = W = 1/v per chunk
    makespan, busy = simulate(make_schedule("interleaved", p, m, v), lambda a: 1 / v, v)
    ideal = m * 3
    assert busy[0] == pytest.approx(ideal)
    assert (makespan - ideal) / ideal == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize("p, m", CASES)
def test_zb_h1_bubble_is_a_third_of_1f1b(p, m):
    """Qi et al. 2024: ZB-H1's bubble is (p - 1)(F + B - W), a third of 1F1B's (p - 1)(F + B + W)
    when F = B = W."""
    cost = lambda a: UNIT[a.kind.value]
    zb, _ = simulate(make_schedule("zb-h1", p, m), cost, split_backward="zb-h1" in SPLIT_BACKWARD)
    one, _ = simulate(make_schedule("1f1b", p, m), cost)
    assert zb - 3 * m == (p - 1) * (1 + 1 - 1)
    assert (zb - 3 * m) * 3 == one - 3 * m


@pytest.mark.parametrize("p, m", CASES)
def test_peak_in_flight_micro_batches(p, m):
    one = make_schedule("1f1b", p, m)
    assert [peak_in_flight(s) for s in one] == [p - r for r in range(p)]  # at most p - r on stage r
    assert [peak_in_flight(s) for s in make_schedule("gpipe", p, m)] == [m] * p
    assert max(peak_in_flight(s) for s in make_schedule("zb-h1", p, m)) == p  # 1F1B's peak
    inter = make_schedule("interleaved", p, m, 2)
    # warm-up plus the first steady forward, unless everything is warm-up (m == p)
    assert [peak_in_flight(s) for s in inter] == [
        min(2 * (p - r - 1) + p + 1, 2 * m) if m != p else 2 * m for r in range(p)]


def test_bad_schedules():
    with pytest.raises(PlanError, match="unknown schedule 'wavy'"):
        make_schedule("wavy", 2, 4)
    with pytest.raises(PlanError, match="multiple of pp=4"):
        make_schedule("interleaved", 4, 6, 2)


def test_grid_prints_one_row_per_stage():
    text = grid(make_schedule("1f1b", 2, 2))
    assert text.splitlines() == ["stage  0: 0F0 1F0 0B0 0W0 1B0 1W0", "stage  1: 0F0 0B0 0W0 1F0 1B0 1W0"]


def test_a_schedule_changed_by_its_caller_is_not_the_next_callers():
    """Schedules are kept for the plans of a search that share them: each caller gets its own lists."""
    first = make_schedule("1f1b", 4, 8)
    kept = [list(actions) for actions in first]
    first[0][0], first[0][5] = first[0][5], first[0][0]
    first[1].clear()
    assert make_schedule("1f1b", 4, 8) == kept


@pytest.mark.parametrize("name, p, m, v", [("gpipe", 4, 8, 1), ("1f1b", 4, 12, 1), ("1f1b", 6, 3, 1),
                                           ("zb-h1", 4, 10, 1), ("interleaved", 4, 8, 2), ("interleaved", 3, 9, 3),
                                           ("interleaved", 4, 4, 2)])
def test_a_stage_digest_holds_what_its_list_says(name, p, m, v):
    """What counting and memory read instead of a stage's list (StageDigest), against the list:
    each micro-batch's actions are its walk's, renumbered; the peak of bytes held, walked
    action by action (F adds a chunk's saved bytes, B frees those W does not read, W the
    rest), is the digest's for any sizes."""
    import random

    from stg.schedule import order

    random.seed(p * m * v)
    schedule = order(name, p, m, v)
    for rank, actions in enumerate(schedule.stages):
        digest = schedule.digest(rank)
        last = {(a.chunk, a.kind): a for a in actions}  # the last of each chunk and kind
        assert digest.finals == set(last.values())
        walked = []
        for sequence, lasts, count in digest.walks:
            walked += [(sequence[0].microbatch, count)]
            mine = [a for a in actions if a.microbatch == sequence[0].microbatch]
            assert list(sequence) == mine and list(lasts) == [last[a.chunk, a.kind] == a for a in mine]
        assert sum(count for _, count in walked) == m
        for i in range(m):  # a micro-batch runs its walk's chunks and kinds, and its lasts
            mine = [a for a in actions if a.microbatch == i]
            assert any([(a.chunk, a.kind, last[a.chunk, a.kind] == a) for a in mine]
                       == [(a.chunk, a.kind, x) for a, x in zip(seq, lasts)] for seq, lasts, _ in digest.walks)
        for _ in range(5):
            saved = [random.randint(0, 100) for _ in range(v)]
            read_by_w = [random.randint(0, s) for s in saved]
            change = {F: saved, B: [r - s for s, r in zip(saved, read_by_w)], W: [-r for r in read_by_w]}
            held = peak = 0
            for a in actions:
                held += change[a.kind][a.chunk]
                peak = max(peak, held)
            weights = [x for c in range(v) for x in (saved[c], read_by_w[c])]
            assert peak == max(sum(w * n for w, n in zip(weights, point)) for point in digest.in_flight)
