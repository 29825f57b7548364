"""The worker's inner step under each `inner.precision`, on two real gloo ranks (FSDP2, the tiny Llama).

bf16 and fp16 use FSDP2's mixed precision: each unit's weights are gathered in the compute dtype (seen inside a
decoder layer's forward), while the shards AdamW steps and the outer step reads stay fp32, and the gradients
are reduced in fp32. fp16 adds a GradScaler: an overflow in one rank's gradient shard skips the step on every rank. fp32 casts nothing.
"""

import dataclasses
import shutil
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from conftest import SameBatch, run_gloo_ranks

from ray_diloco.inner_step import InnerStep, compile_layers, compute_dtype, shard_model
from ray_diloco.model import build_model
from ray_diloco.presets import tiny_cpu

VOCAB = 320


def test_auto_is_bf16_on_a_gpu_and_fp32_on_a_cpu():
    assert compute_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert compute_dtype("auto", torch.device("cpu")) is None
    assert compute_dtype("fp32", torch.device("cuda")) is None
    assert compute_dtype("fp16", torch.device("cpu")) == torch.float16


def _overflow_once(scaler, model) -> None:
    """An inf in one element of rank 0's gradient shard, in the first step only (an fp16 overflow there)."""
    unscale, calls = scaler.unscale_, []

    def poisoned(optimizer):
        if not calls:
            next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
        calls.append(1)
        return unscale(optimizer)

    scaler.unscale_ = poisoned


# A C++ compiler is what inductor needs on a CPU; without one the compiled arm is left out (and its test skips).
LABELS = ("fp32", "bf16", "fp16") + (("fp32-compiled",) if shutil.which("c++") or shutil.which("g++") else ())


class Outcome(NamedTuple):
    dtypes_in_forward: tuple  # (a decoder layer's weight dtype, its output's), inside the forward
    shard_dtypes: set  # the dtypes of the parameters AdamW steps
    losses: list  # of three steps on one batch
    scale: float | None  # the GradScaler's after them
    names: list  # the parameters' names
    compiled: bool  # Module.compile took effect on the decoder layers


def _steps(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    device = torch.device("cpu")
    for label in LABELS:
        precision, compiled = label.split("-")[0], label.endswith("compiled")
        base = tiny_cpu()
        cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, hidden_size=32, intermediate_size=64,
                                                                  num_layers=2, num_heads=2),
                                  inner=dataclasses.replace(base.inner, precision=precision, warmup_steps=0,
                                                            compile=compiled))
        model = build_model(cfg.model, VOCAB, 16, seed=0)
        if compiled:
            compile_layers(model)
        shard_model(model, device, 2, precision)
        seen = []
        proj = model.model.layers[0].self_attn.q_proj
        proj.register_forward_hook(lambda module, args, out: seen.append((module.weight.dtype, out.dtype)))
        step = InnerStep(model, cfg, device, 0)
        if step.scaler and rank == 0:
            _overflow_once(step.scaler, model)
        batch = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(rank))
        losses = [step(SameBatch(batch))[0].item() for _ in range(3)]
        results.put((rank, label, Outcome(
            seen[0], {p.dtype for p in model.parameters()}, losses, step.scaler.get_scale() if step.scaler else None,
            [name for name, _ in model.named_parameters()],
            model.model.layers[0]._compiled_call_impl is not None)))  # what Module.compile sets
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes():
    rows = run_gloo_ranks(_steps, world=2, rows=2 * len(LABELS))
    return {(rank, label): outcome for rank, label, outcome in rows}


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                              ("fp16", torch.float16)])
def test_layers_compute_in_the_precision_while_the_shards_stay_fp32(outcomes, precision, dtype):
    for rank in range(2):
        outcome = outcomes[(rank, precision)]
        assert outcome.dtypes_in_forward == (dtype, dtype)
        assert outcome.shard_dtypes == {torch.float32}
        losses = outcome.losses
        assert all(torch.isfinite(torch.tensor(losses)))
        assert losses[-1] < losses[0], f"{precision}: three steps on one batch should lower its loss: {losses}"


def test_an_fp16_overflow_in_one_ranks_shard_skips_the_step_and_halves_the_scale_on_every_rank(outcomes):
    """Rank 0 alone saw the inf: if the ranks disagreed, one would step its shards and the other not, and
    their loss scales would part."""
    assert [outcomes[(rank, "fp16")].scale for rank in range(2)] == [2.0**15] * 2  # 2**16 halved once
    assert outcomes[(0, "bf16")].scale is None


@pytest.mark.skipif("fp32-compiled" not in LABELS, reason="no C++ compiler: inductor cannot compile on a CPU")
def test_compiled_layers_train_as_the_eager_ones_and_keep_their_parameter_names(outcomes):
    """inner.compile: the same losses (inductor fuses kernels, so to fp32 rounding, not bit for bit) and the same
    parameter names, so a checkpoint of either loads into the other."""
    for rank in range(2):
        eager, compiled = outcomes[(rank, "fp32")], outcomes[(rank, "fp32-compiled")]
        assert compiled.compiled and not eager.compiled
        assert compiled.dtypes_in_forward == (torch.float32, torch.float32)
        assert compiled.losses == pytest.approx(eager.losses, rel=1e-5)
        assert compiled.names == eager.names and not any("_orig_mod" in name for name in compiled.names)


def test_align_puts_the_schedule_back_where_the_workers_window_was_dropped():
    """An abandoned round, or a stop that ends overlapped workers a window ahead, drops the window whose steps their
    schedule already took. `align` only moved it forward: it stayed a window ahead of the outer step, and the
    stop's checkpoint kept that position for the resubmit."""
    cfg = tiny_cpu()

    def at(step: int) -> InnerStep:
        return InnerStep(torch.nn.Linear(2, 2), cfg, torch.device("cpu"), step)

    ahead = at(0)
    for _ in range(12):  # the steps of windows trained
        ahead.scheduler.step()
    assert at(8).lr != ahead.lr
    ahead.align(8)
    assert ahead.scheduler.last_epoch == 8 and ahead.lr == at(8).lr
    ahead.align(10)
    assert ahead.scheduler.last_epoch == 10 and ahead.lr == at(10).lr
