"""The DiLoCo outer step in plain PyTorch against hand-computed references.

Checks the Nesterov update (lr 0.7, momentum 0.9) on a 3-element tensor over two steps, the sign of the
pseudo-gradient (FedAvg as the lr=1, momentum=0 special case), weighted averaging, and the wire codecs.
"""

import pytest
import torch

from ray_diloco.sync.codecs import get_codec
from ray_diloco.sync.outer import OuterOptimizer, pseudo_gradient, weighted_average


def test_one_and_two_nesterov_steps_match_hand_computation():
    outer = OuterOptimizer({"w": torch.tensor([1.0, 2.0, 3.0])}, lr=0.7, momentum=0.9, nesterov=True)
    # Step 1: Δ = [0.5, -0.5, 0]; buf = Δ; update = Δ + 0.9·buf = 1.9·Δ; θ = θ − 0.7·1.9·Δ.
    delta1 = outer.pseudo_gradient({"w": torch.tensor([0.5, 2.5, 3.0])})
    torch.testing.assert_close(delta1["w"], torch.tensor([0.5, -0.5, 0.0]))
    new = outer.step(delta1)
    torch.testing.assert_close(new["w"], torch.tensor([0.335, 2.665, 3.0]), rtol=0, atol=1e-6)
    # Step 2: Δ2 = θ1 − local = [0.335, 0, -1]; buf = 0.9·[0.5,-0.5,0] + Δ2 = [0.785, -0.45, -1];
    # update = Δ2 + 0.9·buf = [1.0415, -0.405, -1.9]; θ2 = θ1 − 0.7·update.
    delta2 = outer.pseudo_gradient({"w": torch.tensor([0.0, 2.665, 4.0])})
    new = outer.step(delta2)
    torch.testing.assert_close(new["w"], torch.tensor([-0.39405, 2.9485, 4.33]), rtol=0, atol=1e-5)
    torch.testing.assert_close(outer.momentum_state()["w"], torch.tensor([0.785, -0.45, -1.0]))
    assert outer.step_count == 2


def test_lr1_no_momentum_one_region_lands_exactly_on_local():
    theta_global = {"a": torch.randn(4, 3), "b": torch.randn(5)}
    local = {k: v + torch.randn_like(v) for k, v in theta_global.items()}
    outer = OuterOptimizer(theta_global, lr=1.0, momentum=0.0, nesterov=False)
    new = outer.step(outer.pseudo_gradient(local))
    for name in local:
        # θ − 1·(θ − local) is local up to one rounding of the subtraction.
        torch.testing.assert_close(new[name], local[name], rtol=0, atol=1e-6)


def test_lr1_no_momentum_many_regions_is_weighted_fedavg():
    torch.manual_seed(0)
    theta_global = {"w": torch.randn(6)}
    locals_ = [{"w": torch.randn(6)} for _ in range(3)]
    weights = [1000.0, 3000.0, 2000.0]
    outer = OuterOptimizer(theta_global, lr=1.0, momentum=0.0, nesterov=False)
    deltas = [outer.pseudo_gradient(loc) for loc in locals_]
    new = outer.step(weighted_average(deltas, weights))
    expected = sum(w * loc["w"] for w, loc in zip(weights, locals_)) / sum(weights)
    torch.testing.assert_close(new["w"], expected, rtol=0, atol=1e-5)


def test_outer_state_is_an_own_fp32_copy():
    source = {"w": torch.ones(3, dtype=torch.bfloat16)}
    outer = OuterOptimizer(source)
    outer.step({"w": torch.ones(3)})
    assert outer.global_state()["w"].dtype == torch.float32
    assert torch.equal(source["w"], torch.ones(3, dtype=torch.bfloat16))


def test_pseudo_gradient_rejects_mismatched_names():
    with pytest.raises(KeyError, match="differ"):
        pseudo_gradient({"a": torch.zeros(1)}, {"b": torch.zeros(1)})


def test_fp16_codec_halves_bytes_and_clamps_instead_of_overflowing():
    tensors = {"w": torch.tensor([1e6, -1e6, 1.0, 70000.0]), "v": torch.zeros(7)}
    fp16, fp32 = get_codec("fp16"), get_codec("none")
    assert fp16.wire_bytes(tensors) * 2 == fp32.wire_bytes(tensors) == 11 * 4
    decoded = fp16.roundtrip(tensors["w"])
    assert torch.isfinite(decoded).all()
    assert decoded.tolist() == [65504.0, -65504.0, 1.0, 65504.0]
    assert decoded.dtype == torch.float32


def test_bf16_codec_keeps_range_and_rounds_precision():
    bf16 = get_codec("bf16")
    x = torch.tensor([1e6, 1.0 + 2**-10])
    decoded = bf16.roundtrip(x)
    assert decoded[0] == pytest.approx(1e6, rel=1e-2)  # range kept (fp16 would clamp to 65504)
    assert decoded[1] == 1.0  # 8 mantissa bits: 1 + 2^-10 rounds to 1
    assert bf16.wire_bytes({"x": x}) == 4


def test_weighted_average_decodes_through_the_codec():
    deltas = [{"w": torch.tensor([1.0 + 2**-12])}, {"w": torch.tensor([3.0])}]
    avg_none = weighted_average(deltas, [1.0, 1.0], "none")
    avg_fp16 = weighted_average(deltas, [1.0, 1.0], "fp16")
    assert avg_none["w"].item() == pytest.approx(2.0 + 2**-13)
    assert avg_fp16["w"].item() == 2.0  # 1 + 2^-12 is not representable in fp16 (10 mantissa bits)
    with pytest.raises(ValueError, match="positive"):
        weighted_average(deltas, [1.0, 0.0])


OUTER_STEPS_SCRIPT = """
import numpy as np, torch
from ray_diloco.sync.outer import OuterOptimizer, state_digest
# Inputs from numpy: torch.randn itself draws differently on the vectorised kernel path.
rng = np.random.default_rng(0)
draw = lambda *shape, scale=1.0: torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32))
outer = OuterOptimizer({"w": draw(100003), "b": draw(37, 11)}, lr=0.7, momentum=0.9, nesterov=True)
for _ in range(5):
    outer.step({n: draw(*t.shape, scale=1e-3) for n, t in outer.global_state().items()})
print(torch.backends.cpu.get_cpu_capability(), state_digest(outer.global_state()))
"""


def test_outer_steps_are_bit_identical_on_every_cpu_kernel_path():
    """The scalar (default) and vectorised (the machine's best) kernels give the same θ_global: torch's own
    SGD did not (its fused multiply-add differs between them)."""
    import os
    import subprocess
    import sys

    best = torch.backends.cpu.get_cpu_capability().lower()
    digests = {}
    for capability in ("default", best):
        done = subprocess.run([sys.executable, "-c", OUTER_STEPS_SCRIPT], capture_output=True, text=True,
                              env={**os.environ, "ATEN_CPU_CAPABILITY": capability}, timeout=120)
        assert done.returncode == 0, done.stderr
        used, digest = done.stdout.split()
        digests[used] = digest
    assert len(digests) == 2 or best == "default", digests  # both kernel paths really ran
    assert len(set(digests.values())) == 1, digests


def test_outer_step_equals_torch_sgd_nesterov():
    torch.manual_seed(0)
    theta = {"w": torch.randn(1000)}
    ours = OuterOptimizer(theta)
    reference = torch.nn.Parameter(theta["w"].clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(4):
        delta = {"w": torch.randn(1000) * 1e-2}
        ours.step(delta)
        reference.grad = delta["w"].clone()
        sgd.step()
    torch.testing.assert_close(ours.global_state()["w"], reference.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.momentum_state()["w"], sgd.state[reference]["momentum_buffer"], rtol=0, atol=1e-6)
