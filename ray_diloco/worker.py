"""The training loop of one worker of a region: FSDP2 shards of the model, inner AdamW, and every H steps
an exchange with the region's SyncActor. It runs inside a Ray Train `TorchTrainer`.

The loop knows nothing about Hivemind or other regions: it trains, hands its shards to the SyncActor and
loads back its rows of θ_global. That keeps it a plain `zero_grad → forward → backward → step` loop.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ray_diloco import metrics, preemption
from ray_diloco.batches import WorkerBatches, region_progress
from ray_diloco.config import ExperimentConfig
from ray_diloco.inner import reset_nonfinite_state
from ray_diloco.inner_step import InnerStep, compile_layers, local_shard, shard_model
from ray_diloco.model import build_model
from ray_diloco.sharding import from_wire, to_wire
from ray_diloco.step_log import StepLog
from ray_diloco.sync import policy
from ray_diloco.worker_checkpoint import load_worker_checkpoint, save_worker_checkpoint


SLOW_REGION_ENV_VAR = "RAY_DILOCO_TEST_SLOW_REGION"  # tests only: "<region>:<seconds or file>[:<from outer step>]"
STEP_IN_GATE = "{step}"  # in a gate's path: one file per outer step (a test lets a region go one round at a time)
GATE_TIMEOUT_SECONDS = 600.0


def test_slowdown(region: str, outer_step: int) -> None:
    """Tests only: hold this region's workers after their H inner steps, before the exchange (a test makes one
    region steadily slower than the others, or late from one round on; read at run time, so a job's runtime_env
    sets it). The value names the region, then seconds to sleep, or an absolute path to wait for (at most
    GATE_TIMEOUT_SECONDS: the test creates it when the region may go on; STEP_IN_GATE in it stands for the outer
    step, a gate per round), then the first outer step it holds."""
    name, _, rest = os.environ.get(SLOW_REGION_ENV_VAR, "").partition(":")
    hold, _, first = rest.partition(":")
    if name != region or not hold or outer_step < int(first or 0):
        return
    if not hold.startswith("/"):
        time.sleep(float(hold))
        return
    gate = gate_for_step(hold, outer_step)
    deadline = time.monotonic() + GATE_TIMEOUT_SECONDS
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not os.path.exists(gate):  # the test's schedule is off from here: say so where its failure will show
        status(f"[{region}] test gate {gate} not there after {GATE_TIMEOUT_SECONDS:.0f} s: going on")


def gate_for_step(gate: str, outer_step: int) -> str:
    """The gate file that holds outer step `outer_step` (STEP_IN_GATE in `gate` stands for it)."""
    return gate.replace(STEP_IN_GATE, str(outer_step))


def status(line: str) -> None:
    """One status line to the driver's console. Not `print`: Ray Train patches print to tee into its
    logger, which shows every line twice on the driver."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


@torch.no_grad()
def load_rows(model: torch.nn.Module, rows: Mapping[str, np.ndarray | torch.Tensor]) -> None:
    rows = from_wire(rows)
    for name, param in model.named_parameters():
        shard = local_shard(param)
        shard.copy_(rows[name].to(device=shard.device, dtype=shard.dtype).reshape(shard.shape))


def shards_of(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """This rank's shards in fp32 on the CPU, as the SyncActor's wire takes them (`to_wire`): views of the
    parameters where they are fp32 on the CPU already, which Ray copies when the call is made."""
    return to_wire({name: local_shard(p).detach().float().cpu() for name, p in model.named_parameters()})


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a collective: all ranks must call it), fp32 on CPU."""
    return {name: (p.data.full_tensor() if isinstance(p.data, DTensor) else p.data).detach().float().cpu()
            for name, p in model.named_parameters()}


def sync_status(region: str, reached: int, outer_steps: int, seconds: float, last_round: dict,
                advanced: bool = True) -> str:
    """Rank 0's line after an exchange. With outer.overlap the round of this step is still running: the line
    names the newest round that completed (none yet after the first exchange). Not `advanced`: the round was
    abandoned (the SyncActor's bound): the workers train towards the same outer step again, on the next batches
    (the abandoned window's Δ is lost, its batches are not read again)."""
    if not advanced:
        return (f"[{region}] outer step {reached + 1}/{outer_steps}: the round was abandoned after {seconds:.0f}s; "
                "training towards it again on the next batches")
    if last_round.get("outer_step", -1) + 1 == reached:
        return (f"[{region}] outer step {reached}/{outer_steps} synced in {seconds:.2f}s with "
                f"{last_round['group_size']} region(s): {', '.join(last_round['peers'])}")
    newest = (f"step {last_round['outer_step'] + 1} synced with {last_round['group_size']} region(s)"
              if last_round else "no round completed yet")
    return (f"[{region}] outer step {reached}/{outer_steps} handed in after {seconds:.2f}s; its round runs "
            f"while training goes on ({newest})")


def restore_region_state(sync_actor, model, inner_step: InnerStep, rank: int, world_size: int,
                         inner_steps: int) -> dict:
    """A (re)starting worker continues from its region's state: θ_global and the outer step from the
    SyncActor (not the init: a restarted, resumed or joining region starts from the run's current state), the
    inner AdamW state and schedule position from the worker checkpoint of that same outer step when one is
    committed, and the region's data position after that outer step. Returns the SyncActor's answer
    (`resume_state`: outer_step, progress, worker_checkpoint, stop)."""
    point = ray.get(sync_actor.resume_state.remote(rank, world_size))  # one call: one consistent state
    restored = restore_from(point, model, inner_step, inner_steps)
    if rank == 0 and point["outer_step"] > 0:
        sync_actor.record_event.remote("inner_state_restored" if restored else "inner_state_reset",
                                       checkpoint=point["worker_checkpoint"])
    return point


def restore_from(point: dict, model, inner_step: InnerStep, inner_steps: int) -> bool:
    """Load the SyncActor's `point` (its `resume_state`: outer_step, this rank's rows of θ_global, the committed
    worker checkpoint of that step or None) into the model, the inner AdamW state and the schedule (collective where
    there is a checkpoint). Returns whether AdamW state was restored (not: it starts anew)."""
    rows = from_wire(point["rows"])
    inner_position = point["outer_step"] * inner_steps
    restored = False
    if point["worker_checkpoint"] is not None:
        meta = load_worker_checkpoint(point["worker_checkpoint"], model, inner_step.optimizer)
        if meta["holds_theta_global"]:
            mismatched = [name for name, p in model.named_parameters()
                          if not _equals_rows(local_shard(p), rows[name])]
            consistent = not mismatched and meta["outer_step"] == point["outer_step"]
            inner_position = meta["inner_step"]
        else:  # saved at a hand-in of step meta["outer_step"] (save_at_hand_in), for the step its round reached (one
            # on, a re-sync's later one, or the same after a round in flight was abandoned): θ_global comes from the
            # SyncActor, and the schedule goes on from that step, as the workers aligned it
            load_rows(model, rows)
            mismatched, consistent = [], meta["outer_step"] <= point["outer_step"]
        if not consistent:
            raise RuntimeError(f"worker checkpoint {point['worker_checkpoint']} (outer step {meta['outer_step']}) "
                               f"does not hold θ_global of outer step {point['outer_step']} ({len(mismatched)} "
                               "tensors differ): the checkpoint store is inconsistent")
        # Written by a group that trained no step (restarted after its region's stop): AdamW starts anew, as with no
        # checkpoint (load_worker_checkpoint leaves it empty), and the event says so. So does one saved at a hand-in
        # whose moments had gone non-finite (the round the region then sat out), as the loop resets them after it.
        restored = not meta["fresh_inner_state"] and not reset_nonfinite_state(inner_step.optimizer)
    else:
        load_rows(model, rows)
    inner_step.align(inner_position)
    return restored


def _equals_rows(shard: torch.Tensor, rows: torch.Tensor) -> bool:
    return torch.equal(shard, rows.to(shard).reshape(shard.shape))


def checkpoint_region(sync_actor, model, inner_step: InnerStep, experiment_uri: str, outer_step: int, rank: int,
                      world_size: int, fresh_inner_state: bool = False) -> None:
    """Worker checkpoint first (every rank uploads), then the SyncActor commits its outer checkpoint that
    points at it: a committed outer checkpoint always has a complete worker checkpoint beside it.
    `fresh_inner_state`: the group trained no step (its AdamW state holds nothing to restore)."""
    location = save_worker_checkpoint(model, inner_step.optimizer, experiment_uri, outer_step,
                                      inner_step.scheduler.last_epoch, rank, world_size, fresh_inner_state)
    if rank == 0:
        ray.get(sync_actor.commit_checkpoint.remote(outer_step, location))


def save_at_hand_in(model, inner_step: InnerStep, experiment_uri: str, outer_step: int, inner_steps: int, rank: int,
                    world_size: int) -> str:
    """Under a preemption notice known as the workers hand in outer step `outer_step` (a window ended early, an
    earlier look found one, or a look before an overlapped exchange): their part of the checkpoint of the step the
    round reaches, saved before the round (every rank uploads; collective) and named after the step handed in.
    AdamW as the workers go on with it, and the model as trained: the loader takes θ_global from the SyncActor
    instead (`holds_theta_global`), and the schedule from the step the round reached. The SyncActor commits it as
    the round ends (`policy.commits_hand_in_checkpoint`), so a round that meets the other regions after the
    deadline, the group gone, still leaves the inner state to the group that follows. Returns where it is stored."""
    return save_worker_checkpoint(model, inner_step.optimizer, experiment_uri, outer_step,
                                  (outer_step + 1) * inner_steps, rank, world_size, holds_theta_global=False)


def look_for_notice(sync_actor, watch: preemption.NoticeWatch, region: str, rank: int) -> bool:
    """Whether a preemption notice stands: every rank asks at the same point (a barrier; the points are in
    ray_diloco/preemption.py). Where the workers first see one, rank 0 records it (event and status line)."""
    notice, first_seen = watch.check()
    if first_seen and rank == 0:
        left = watch.deadline() - time.time()
        sync_actor.record_event.remote("preemption_noticed", nodes=notice.preempted_node_ids,
                                       ranks=notice.preempted_ranks, seconds_left=round(left, 1),
                                       deadline_stated=notice.deadline_ms is not None)
        status(f"[{region}] preemption notice: node(s) {', '.join(notice.preempted_node_ids)} go in "
               f"about {left:.0f}s; every round is checkpointed until then")
    return notice is not None


def ends_window_early(sync_actor, watch: preemption.NoticeWatch, region: str, rank: int, outer_step: int,
                      trained: int, inner_steps: int, window_seconds: float, round_seconds: float | None) -> bool:
    """Mid-window, after `trained` of the window's inner steps (`window_seconds` so far): whether a preemption
    notice stands and the rest of the window with its round would not end before its deadline, so the group hands in
    what it trained now (ray_diloco/preemption.py). Every rank asks at the same step (barriers)."""
    if not look_for_notice(sync_actor, watch, region, rank):
        return False
    rest = window_seconds / trained * (inner_steps - trained)
    if not preemption.hand_in_decision(watch.deadline(), rest, round_seconds):
        return False
    if rank == 0:
        left = watch.deadline() - time.time()
        sync_actor.record_event.remote("window_ended_early", outer_step=outer_step, inner_steps=trained,
                                       of=inner_steps, seconds_left=round(left, 1))
        status(f"[{region}] outer step {outer_step + 1}: the window ends after {trained} of {inner_steps} inner "
               f"steps, {left:.0f}s before the preemption deadline, so its round and checkpoint end in time")
    return True


def wait_for_round(answer, sync_actor, watch: preemption.NoticeWatch, region: str, outer_step: int, rank: int,
                   save_hand_in: Callable[[], str]) -> tuple[tuple, bool, str | None]:
    """This rank's answer from the round it handed in (`answer`: its `SyncActorImpl.exchange` call), looking for a
    preemption notice every ROUND_LOOK_SECONDS while the round waits (for the other regions, or the round in flight):
    a round may outlast a notice's deadline, and the group Ray Train starts then would begin AdamW anew. Where a look
    finds one and the round has not ended, rank 0 tells the SyncActor first (`notice_in_round`: a round not yet
    scheduled blocks, to be checkpointed), the workers save their hand-in checkpoint (`save_hand_in`, collective),
    and rank 0 offers it (`late_hand_in`). Returns the answer, whether the round runs under the notice (False where
    it had ended, perhaps overlapped: the next look finds the notice again), and the checkpoint the SyncActor took.
    Rank 0 decides whether the round ended (a barrier each look): a rank that went on while another looked would
    block the group. A rank whose own call failed raises at once (Ray Train restarts the group)."""
    while True:
        ended = bool(ray.wait([answer], timeout=preemption.ROUND_LOOK_SECONDS if rank == 0 else 0)[0])
        if ended:
            ray.get(answer)  # raises where this rank's exchange failed
        if ray.train.collective.broadcast_from_rank_zero(ended):
            return ray.get(answer), False, None
        if not look_for_notice(sync_actor, watch, region, rank):
            continue
        in_round = ray.train.collective.broadcast_from_rank_zero(
            rank == 0 and ray.get(sync_actor.notice_in_round.remote(outer_step)))
        if not in_round:
            return ray.get(answer), False, None
        location = save_hand_in()
        taken = ray.train.collective.broadcast_from_rank_zero(
            rank == 0 and ray.get(sync_actor.late_hand_in.remote(outer_step, location)))
        if rank == 0:
            sync_actor.record_event.remote("saved_in_round", outer_step=outer_step, taken=taken)
        return ray.get(answer), True, location if taken else None


def round_estimate(exchange_seconds: float, last_round: dict, checkpoint_seconds: float) -> float:
    """What a round under a preemption notice takes with its checkpoint, from the last: the exchange as the workers
    waited for it or, where it ran while they trained on (outer.overlap; under a notice it blocks), the round as
    the SyncActor timed it (`last_round`: rank 0's; the decisions are rank 0's), plus the last checkpoint's time
    (every round under a notice has one)."""
    return max(exchange_seconds, last_round.get("seconds", 0.0)) + checkpoint_seconds


def wait_out_notice(sync_actor, watch: preemption.NoticeWatch, region: str, outer_step: int, round_seconds: float,
                    rank: int) -> None:
    """Under a preemption notice, after the round's checkpoint: wait for the deadline where another window might
    not end before it (ray_diloco/preemption.py). Events say what the group did."""
    deadline = watch.deadline()
    waits, left = preemption.waits_for_deadline(deadline, round_seconds), deadline - time.time()
    if rank == 0:
        sync_actor.record_event.remote("preemption_notice", outer_step=outer_step,
                                       nodes=watch.notice.preempted_node_ids, seconds_left=round(left, 1),
                                       round_seconds=round(round_seconds, 1), waits_for_deadline=waits)
        status(f"[{region}] outer step {outer_step} checkpointed under a preemption notice ({left:.0f}s to the "
               f"deadline): {'waiting for it' if waits else 'training on'}")
    if waits:
        preemption.sleep_past_deadline(deadline)


def run_actors(loop_config: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The region's SyncActor (None in a baseline), the run's evaluator (None without mid-run evaluations) and the
    region's data stream, by the names the driver gave them (`driver.make_trainer` says why not handles)."""
    def named(key: str) -> Any:
        name = loop_config.get(key)
        return ray.get_actor(name, namespace=loop_config["namespace"]) if name else None

    return named("sync_actor"), named("evaluator"), named("stream")


def region_train_loop(loop_config: dict[str, Any]) -> dict[str, Any]:
    """`train_loop_per_worker` of a group's TorchTrainer.

    DiLoCo (a SyncActor is given): every H inner steps the rank exchanges its shards for its rows of the
    new θ_global. ddp / single (no SyncActor): the same loop with no outer step; the group's gradient
    reduce-scatter every step is the data-parallel baseline. Rank 0 returns the counters (and, without a
    SyncActor, the final full model)."""
    notice_watch = preemption.NoticeWatch()  # first: a notice that comes while the group starts counts from here
    cfg = ExperimentConfig.from_dict(loop_config["experiment"])
    region: str = loop_config["region"]
    sync_actor, evaluator, stream = run_actors(loop_config)
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    torch.set_num_threads(max(1, int(loop_config.get("threads_per_worker", 1))))

    model = build_model(cfg.model, cfg.model.vocab_size, cfg.data.seq_len, cfg.run.seed, cfg.run.init_from)
    if cfg.inner.compile:
        compile_layers(model)
    shard_model(model.to(device), device, world_size, cfg.inner.precision)
    H = cfg.outer.inner_steps
    inner_step = InnerStep(model, cfg, device, 0)
    start = {"outer_step": 0, "progress": None, "worker_checkpoint": None, "stop": False}
    if sync_actor is not None:
        ray.get(sync_actor.register_worker.remote(rank, world_size, os.getpid(), socket.gethostname(),
                                                  ray.get_runtime_context().get_node_id()))
        start = restore_region_state(sync_actor, model, inner_step, rank, world_size, H)
    batches = WorkerBatches(stream, device, rank, world_size, start["progress"])

    tokens_total, last_sync_seconds, sync_seconds_total, checkpoint_seconds = 0, 0.0, 0.0, 0.0
    step_rates: list[float] = []  # tokens/s of each inner step: the steady state, without start-up waits
    sync_waits: list[tuple[float, float]] = []  # per exchange: (seconds into the loop at its end, seconds waited)
    loop_started = time.perf_counter()
    peers = str(len(cfg.regions)) if sync_actor is not None else "-"
    flops_token = metrics.flops_per_token(cfg.model, cfg.model.vocab_size, cfg.data.seq_len)
    peak = metrics.peak_flops(device.type, torch.cuda.get_device_name(device) if device.type == "cuda" else "")
    loss_curve: list[tuple[int, float]] = []  # rank 0: (inner step, loss), for loss.png
    step_log = StepLog(device, world_size, cfg.run.log_every)
    last = None  # the newest flushed step

    def flush_steps() -> None:
        """Numbers for the steps since the last flush: metrics, rank 0's loss curve and status lines."""
        nonlocal last
        for record in step_log.flush():
            last = record
            step_rates.append(record.tokens / record.seconds)
            metrics.safely(metrics.record_inner_step, cfg.run.name, region, rank, record.seconds, record.tokens,
                           flops_token, peak, record.loss if rank == 0 else None, record.lr if rank == 0 else None)
            if rank == 0:
                loss_curve.append((record.step, record.loss))
                status(f"[{region}] step {record.step}/{cfg.total_inner_steps}"
                       f" | outer {(record.step - 1) // H + 1}/{cfg.run.outer_steps} | loss {record.loss:.4f}"
                       f" | lr {record.lr:.2e} | {record.tokens / record.seconds:,.0f} tok/s/worker"
                       f" | last sync {last_sync_seconds:.2f}s | peers {peers}")

    def checkpoint_taken(started: float) -> float:
        """A worker checkpoint saved since `started`: its seconds counted (and returned) and, from rank 0, metered."""
        nonlocal checkpoint_seconds
        seconds = time.perf_counter() - started
        checkpoint_seconds += seconds
        if rank == 0:
            metrics.safely(metrics.record_checkpoint, cfg.run.name, region, seconds=seconds)
        return seconds

    def save_hand_in(handed_in: int) -> str:
        """The workers' hand-in checkpoint for their round of outer step `handed_in` (save_at_hand_in), timed."""
        nonlocal last_checkpoint_seconds
        started = time.perf_counter()
        location = save_at_hand_in(model, inner_step, loop_config["worker_checkpoints"], handed_in, H, rank,
                                   world_size)
        last_checkpoint_seconds = checkpoint_taken(started)
        return location

    outer_step, stopped = start["outer_step"], start["stop"]
    if stopped and start["worker_checkpoint"] is None:  # restarted after the stop's round, before its commit
        checkpoint_region(sync_actor, model, inner_step, loop_config["worker_checkpoints"], outer_step, rank,
                          world_size, fresh_inner_state=True)
        checkpoint_seconds = time.perf_counter() - loop_started
    # Rank 0's time per inner step in this group's last window: it spaces the mid-window looks for a notice.
    step_seconds = None
    # What a round with its checkpoint takes (`round_estimate`), for the notice's decisions (rank 0's count): until
    # this group has run a round, the region's last one as the SyncActor timed it, since a notice may come in a
    # restarted group's first window too; None before the SyncActor has run one (a start, resubmit or join).
    last_round: dict = ray.get(sync_actor.last_round.remote()) if sync_actor is not None else {}
    round_seconds, last_checkpoint_seconds = last_round.get("seconds"), 0.0
    while outer_step < cfg.run.outer_steps and not stopped:
        tokens_this_round, window_started, trained = 0, time.perf_counter(), H
        # Inner steps after which the group looks for a preemption notice mid-window; in the group's first window,
        # spaced anew once its TIMED_STEP is timed (from the device's end of one step to that of the next).
        looks = preemption.looks_within_window(H, step_seconds) if sync_actor is not None else frozenset()
        times_a_step = sync_actor is not None and step_seconds is None and H > preemption.TIMED_STEP
        timed_from = window_started
        step_log.restart_clock()
        for inner in range(H):
            lr = inner_step.lr  # the rate this step uses (the scheduler moves on inside the step)
            loss, tokens = inner_step(batches)
            tokens_this_round += tokens
            if times_a_step and inner + 1 in (preemption.TIMED_STEP - 1, preemption.TIMED_STEP):
                loss.item()  # waits for the device
                if inner + 1 == preemption.TIMED_STEP:
                    looks = preemption.first_window_looks(
                        H, preemption.agreed_step_seconds(1, time.perf_counter() - timed_from))
                timed_from = time.perf_counter()
            if step_log.record(outer_step * H + inner + 1, loss, tokens, lr):
                flush_steps()
            if inner + 1 in looks and ends_window_early(sync_actor, notice_watch, region, rank, outer_step, inner + 1,
                                                        H, time.perf_counter() - window_started, round_seconds):
                trained = inner + 1
                break
        flush_steps()  # the window's last steps, before the exchange (which waits for the device anyway)
        tokens_total += tokens_this_round
        window_ended = time.perf_counter()
        if sync_actor is not None:
            step_seconds = preemption.agreed_step_seconds(trained, window_ended - window_started)
            if rank == 0 and last is not None:  # fire-and-forget, once per round: the driver's live summary line
                sync_actor.note_inner.remote(last.loss, last.tokens / last.seconds, last.lr)
            test_slowdown(region, outer_step)
            # A preemption notice (a node of the group goes soon), looked for once a round: before the exchange
            # where rounds may overlap (one under a notice must not: it is checkpointed), else after it, the
            # latest news, where the round that just ended can still be checkpointed; told with the hand-in where
            # known then (preemption.told_with_hand_in).
            notice = preemption.told_with_hand_in(
                trained < H, cfg.outer.overlap, lambda: look_for_notice(sync_actor, notice_watch, region, rank),
                lambda: notice_watch.notice is not None)
            hand_in_checkpoint = None
            # Under a notice the workers checkpoint now, as the round may end after the deadline: the SyncActor commits
            # it as the round ends (that commit's time counts in the exchange's).
            if notice:
                hand_in_checkpoint = save_hand_in(outer_step)
            sync_started = time.perf_counter()
            answer = sync_actor.exchange.remote(outer_step, rank, world_size, shards_of(model), tokens_this_round,
                                                batches.progress(), notice, hand_in_checkpoint)
            if notice:
                reached, rows, stop = ray.get(answer)
            else:  # a notice may come while the round waits: the workers then save as they would have at the hand-in
                saved_before = checkpoint_seconds
                (reached, rows, stop), notice, hand_in_checkpoint = wait_for_round(
                    answer, sync_actor, notice_watch, region, outer_step, rank, lambda: save_hand_in(outer_step))
                sync_started += checkpoint_seconds - saved_before  # a save in the round counts as a checkpoint's
            load_rows(model, rows)
            if reset_nonfinite_state(inner_step.optimizer):  # this rank's moments went NaN: start them anew
                sync_actor.record_event.remote("inner_state_reset_nonfinite", rank=rank)
            last_sync_seconds = time.perf_counter() - sync_started
            sync_waits.append((round(time.perf_counter() - loop_started, 3), round(last_sync_seconds, 3)))
            sync_seconds_total += last_sync_seconds
            # Re-synced to a later step, the window did not advance the outer step, or it ended early: the schedule
            # follows the outer steps.
            if reached != outer_step + 1 or trained < H:
                inner_step.align(reached * H)
            advanced = reached != outer_step  # not: the round was abandoned, this window's Δ is lost
            if rank == 0:
                last_round = ray.get(sync_actor.last_round.remote())
                peers = str(last_round.get("group_size", peers))
                status(sync_status(region, reached, cfg.run.outer_steps, last_sync_seconds, last_round, advanced))
            # Whether the SyncActor committed the hand-in checkpoint with the state the round reached: rank 0's read,
            # for every rank (each reading its own could see a later commit and decide apart on a collective save).
            # Every rank agrees whether there is one (the notice and `taken` are rank 0's).
            committed = hand_in_checkpoint is not None and ray.train.collective.broadcast_from_rank_zero(
                rank == 0 and tuple(
                    ray.get(sync_actor.committed_checkpoint.remote()) or ()) == (reached, hand_in_checkpoint))
            outer_step = reached
            if not cfg.outer.overlap and trained == H:
                notice = look_for_notice(sync_actor, notice_watch, region, rank)
            metrics.safely(metrics.record_compute_utilization, cfg.run.name, region, rank,
                           1 - (sync_seconds_total + checkpoint_seconds) / (time.perf_counter() - loop_started))
            if not committed and policy.checkpoints_at(outer_step, cfg.run.checkpoint_every, stop, advanced, notice):
                checkpoint_started = time.perf_counter()
                checkpoint_region(sync_actor, model, inner_step, loop_config["worker_checkpoints"], outer_step,
                                  rank, world_size)
                last_checkpoint_seconds = checkpoint_taken(checkpoint_started)
            round_seconds = round_estimate(last_sync_seconds, last_round, last_checkpoint_seconds)
            if stop:  # the run was asked to stop; started again under its name, it goes on from here
                stopped = True
                break
            if notice and outer_step < cfg.run.outer_steps:  # a whole window's time, where this one ended early
                window_seconds = (window_ended - window_started) * H / trained
                wait_out_notice(sync_actor, notice_watch, region, outer_step, window_seconds + round_seconds, rank)
        else:
            outer_step += 1
            if evaluator is not None and cfg.run.eval_every and outer_step % cfg.run.eval_every == 0:
                state = full_state(model)  # every rank takes part in the gather
                if rank == 0:
                    evaluator.evaluate.remote(outer_step, to_wire(state))
    # Every rank's data progress, for the region's position and fingerprint of the windows it trained on.
    progress_by_rank = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(progress_by_rank, batches.progress())
    else:
        progress_by_rank = [batches.progress()]
    result = {"rank": rank, "tokens_per_worker": tokens_total, "epochs": batches.epoch, "world_size": world_size,
              "data": region_progress(progress_by_rank),
              "median_step_tokens_per_second": statistics.median(step_rates) if step_rates else 0.0,
              # Time in the loop, and the parts of it this rank waited on outer steps and wrote checkpoints:
              # the rest is compute (compute utilization).
              "train_seconds": time.perf_counter() - loop_started, "sync_wait_seconds": sync_seconds_total,
              "checkpoint_seconds": checkpoint_seconds, "stopped": stopped, "outer_step": outer_step,
              "sync_waits": sync_waits}
    result["loss_curve"] = loss_curve  # rank 0's, since this worker started
    if sync_actor is None:
        state = full_state(model)
        if rank == 0:  # Ray Train refuses torch tensors in return values; numpy arrays travel fine
            result["final_state"] = {name: t.numpy() for name, t in state.items()}
    return result
