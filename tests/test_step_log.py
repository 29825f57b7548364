"""`StepLog`: per-step losses and times read with one collective and one host sync per flush, never per step.

Checked against hand-computed values: the group mean of each step's loss across two real gloo ranks, the step
numbers, tokens and learning rates as recorded, step times that add up to the wall time, and the count of
collectives (one per flush).
"""

import time

import torch
import torch.distributed as dist

from conftest import run_gloo_ranks

from ray_diloco.step_log import StepLog


def test_one_rank_flushes_every_n_steps_with_the_recorded_values():
    log = StepLog(torch.device("cpu"), world_size=1, every=3)
    due = []
    for step in range(1, 8):
        time.sleep(0.01)
        due.append(log.record(step, torch.tensor(float(step) / 2), tokens=100 + step, lr=0.1 * step))
        if due[-1]:
            records = log.flush()
            assert [r.step for r in records] == [step - 2, step - 1, step]
    assert due == [False, False, True, False, False, True, False]
    rest = log.flush()
    assert [(r.step, r.loss, r.tokens) for r in rest] == [(7, 3.5, 107)]
    assert abs(rest[0].lr - 0.7) < 1e-12
    assert log.flush() == []  # nothing since


def test_step_times_add_up_to_the_wall_time_and_exclude_what_came_before_restart_clock():
    log = StepLog(torch.device("cpu"), world_size=1, every=100)
    time.sleep(0.2)  # e.g. an exchange: not a step's time
    log.restart_clock()
    started = time.perf_counter()
    for step in range(1, 4):
        time.sleep(0.05)
        log.record(step, torch.tensor(1.0), tokens=1, lr=0.0)
    wall = time.perf_counter() - started
    records = log.flush()
    assert all(0.04 < r.seconds < 0.5 for r in records), records
    assert abs(sum(r.seconds for r in records) - wall) < 0.05  # the 0.2 s before restart_clock is in no step


def _two_ranks(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    calls = []
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    dist.all_reduce = counting
    log = StepLog(torch.device("cpu"), world_size=2, every=4)
    flushed = []
    for step in range(1, 11):  # rank 0's loss is step, rank 1's is 10 × step
        if log.record(step, torch.tensor(float(step) * (1 if rank == 0 else 10)), tokens=8, lr=0.0):
            flushed += log.flush()
    flushed += log.flush()
    dist.destroy_process_group()
    results.put((rank, [(r.step, r.loss) for r in flushed], [tuple(s) for s in calls]))


def test_two_gloo_ranks_get_each_steps_group_mean_with_one_collective_per_flush():
    outcome = {rank: (flushed, calls) for rank, flushed, calls in run_gloo_ranks(_two_ranks, world=2, rows=2,
                                                                                 timeout=120)}
    for rank in range(2):
        flushed, calls = outcome[rank]
        assert flushed == [(step, 5.5 * step) for step in range(1, 11)]  # (step + 10·step) / 2
        assert calls == [(4,), (4,), (2,)], calls  # 10 steps, every 4: three collectives, not ten
