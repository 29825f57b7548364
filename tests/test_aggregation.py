"""How a round combines the regions' contributions (ray_diloco.sync.aggregation), against hand-computed values:

* the norm is the same in any order of summation (members of a compressed round clip for themselves);
* the lower median, the clip scales, and the clipped mean of three Δ one of which is ×1000;
* under `mean` every scale is 1 and the result is the token-weighted mean;
* a property (hypothesis): under `clipped`, every contribution after its scale and the result itself have a norm of
  at most c × the median norm, whatever one member sends (×10⁶, sign-flipped, zeros);
* a compressed method's aggregate under `clipped` (Compressor.aggregate_decoded): the inflated payload is scaled by
  c × median / its norm, per tensor, and the result is that weighted sum;
* over real Hivemind (RegionAverager, the dense all-reduce): a sender declaring more tokens than the run's largest
  region trains is left out of the parts an honest reducer reduces; under `clipped` three regions, one sending
  1000 × its Δ, still hold the same bytes, the average stays of the honest Δs' size, and each region names it.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from test_averaging import SHAPES, assert_identical, make_delta, run_round, shutdown, start_regions

from ray_diloco.methods.compressors import Compressor
from ray_diloco.methods.settings import MethodSettings
from ray_diloco.sync.aggregation import clip_scales, combine, exact_norm, lower_median
from ray_diloco.sync.codecs import get_codec


def test_the_lower_median_and_the_clip_scales():
    assert lower_median([3.0, 1.0, 2.0]) == 2.0
    assert lower_median([4.0, 1.0, 3.0, 2.0]) == 2.0  # even count: the lower middle value
    assert clip_scales([1.0, 2.0, 100.0], factor=2.0) == [1.0, 1.0, 0.04]  # bound 2 × 2 = 4
    assert clip_scales([0.0, 0.0, 5.0], factor=2.0) == [1.0, 1.0, 0.0]  # a median of zero clips the rest to zero


def test_the_norm_is_the_same_in_any_order_of_summation():
    """Members of a compressed round clip for themselves: their norms must agree to the last bit on any machine."""
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-8, 8, 100_000)
    shuffled = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(1))]
    assert exact_norm(x) == exact_norm(x.flip(0)) == exact_norm(shuffled) == exact_norm(x.reshape(100, 1000))
    assert exact_norm(x) == pytest.approx(float(torch.linalg.vector_norm(x.double())), rel=1e-12)


def test_a_delta_scaled_by_1000_is_cut_to_c_times_the_median_norm():
    honest_a, honest_b = torch.tensor([3.0, 4.0]), torch.tensor([0.0, 5.0])
    poisoned = 1000 * torch.tensor([3.0, 4.0])  # norm 5000; the median norm is 5, c = 2: scale 10 / 5000
    combined, scales = combine([(1.0, honest_a), (1.0, honest_b), (1.0, poisoned)], "clipped", 2.0)
    assert scales == [1.0, 1.0, pytest.approx(0.002)]
    assert torch.allclose(combined, torch.tensor([(3 + 0 + 6) / 3, (4 + 5 + 8) / 3]))
    mean, scales = combine([(1.0, honest_a), (3.0, honest_b)], "mean", 2.0)
    assert scales == [1.0, 1.0] and torch.equal(mean, torch.tensor([0.75, 4.75]))
    with pytest.raises(ValueError, match="positive weight"):
        combine([(0.0, honest_a)], "mean", 2.0)
    with pytest.raises(ValueError, match="not one of"):
        combine([(1.0, honest_a)], "median", 2.0)


@settings(max_examples=200, deadline=None)
@given(honest=st.lists(st.lists(st.floats(-10, 10), min_size=4, max_size=4), min_size=2, max_size=6),
       weights=st.lists(st.integers(1, 5000), min_size=7, max_size=7),
       attack=st.sampled_from([1e6, -1.0, 0.0, 1e-6]), factor=st.floats(1.0, 4.0))
def test_clipped_contributions_and_their_mean_stay_within_c_times_the_median_norm(honest, weights, attack, factor):
    blocks = [torch.tensor(x) for x in honest]
    blocks.append(attack * blocks[0])  # one member sends an inflated, flipped or vanishing copy
    weighted = list(zip(map(float, weights), blocks))
    combined, scales = combine(weighted, "clipped", factor)
    norms = [float(torch.linalg.vector_norm(b, dtype=torch.float64)) for b in blocks]
    bound = factor * lower_median(norms)
    for norm, scale in zip(norms, scales):
        assert 0.0 <= scale <= 1.0 and norm * scale <= bound * (1 + 1e-6) + 1e-30
    assert float(torch.linalg.vector_norm(combined)) <= bound * (1 + 1e-5) + 1e-30


def test_a_compressed_aggregate_clips_the_inflated_payload_per_tensor():
    shapes = {"v": (16,), "w": (4, 4)}
    settings_ = MethodSettings("sparseloco", 16, 4, 8, 0.0, aggregation="clipped", clip_factor=2.0)
    regions = [Compressor(settings_, shapes) for _ in range(3)]
    g = torch.Generator().manual_seed(0)
    deltas = [{name: torch.randn(shape, generator=g) for name, shape in shapes.items()} for _ in range(3)]
    deltas[2] = {name: 1000 * t for name, t in deltas[2].items()}
    decoded = [(1000 * (i + 1), c.decode_payload(c.compress(d)[0])) for i, (c, d) in enumerate(zip(regions, deltas))]
    averaged, smallest = regions[0].aggregate_decoded(decoded)
    assert smallest[:2] == [1.0, 1.0] and smallest[2] < 0.01
    total = sum(w for w, _ in decoded)
    for name, shape in shapes.items():
        norms = [float(torch.linalg.vector_norm(parts[name][1], dtype=torch.float64)) for _, parts in decoded]
        bound = 2.0 * sorted(norms)[1]
        expected = torch.zeros(math.prod(shape))
        for (weight, parts), norm in zip(decoded, norms):
            indices, values = parts[name]
            scale = min(1.0, bound / norm)
            expected[indices.reshape(-1)] += values.reshape(-1) * weight * scale / total
        assert torch.allclose(averaged[name].reshape(-1), expected, rtol=1e-5, atol=1e-6), name
    # A region that would take the plain mean decodes the same payloads to another result: its digest differs.
    plain = Compressor(MethodSettings("sparseloco", 16, 4, 8, 0.0), shapes)
    assert plain.decoder_digest() != regions[0].decoder_digest()


def test_a_sender_declaring_more_tokens_than_any_region_trains_is_left_out_of_our_parts():
    """issue 24: Δ is averaged weighted by the tokens each sender declares; a member declaring 10^12 took every
    part it sent (the mean was its Δ). Past max_weight (`ExperimentConfig.max_round_tokens`: the run's largest
    region's tokens per round) a reducer refuses the sender's parts: the parts r0 reduces hold r0's Δ alone, and
    r0 reports the round inconsistent. (The parts the inflated member reduces itself it controls anyway: a
    butterfly all-reduce trusts each reducer with its part; the compressed methods' all-gather does not.)"""
    # Parts of 1,024 values: each region reduces about half of them, whichever order the group has.
    regions = start_regions(2, run_id="weights", max_weight=1000.0, part_size_bytes=2**12)
    deltas = [make_delta(seed=0), make_delta(seed=1)]
    try:
        honest, _ = run_round([(regions[0], deltas[0], 1000.0, 0), (regions[1], deltas[1], 1e12, 0)])
    finally:
        shutdown(regions)
    codec = get_codec("fp16")
    own = torch.cat([codec.roundtrip(deltas[0][name]).reshape(-1) for name in SHAPES])
    got = torch.cat([honest.averaged[name].reshape(-1) for name in SHAPES])
    assert (got == own).float().mean() > 0.3  # r0's own part: its Δ alone (the old code: the inflated Δ's)
    assert not honest.consistent


def test_clipped_aggregation_bounds_a_poisoned_delta_and_every_region_names_it():
    """issue 24, outer.aggregation 'clipped' (ray_diloco.sync.aggregation): r2 sends 1000 × a Δ. Each reducer clips
    its parts to 2 × the median norm of that part: the three regions still hold the same bytes, the average stays
    of the honest Δs' size (under the mean it would be ~333× it), and every region names r2 as clipped."""
    regions = start_regions(3, run_id="clipped", compression="scaled-fp16", aggregation="clipped", clip_factor=2.0,
                            part_size_bytes=2**12)  # every region reduces parts of every tensor
    g = torch.Generator().manual_seed(0)
    deltas = [{name: 1e-2 * torch.randn(shape, generator=g) for name, shape in SHAPES.items()} for _ in range(3)]
    deltas[2] = {name: 1000 * t for name, t in deltas[2].items()}
    try:
        results = run_round([(a, d, 1000.0, 0) for a, d in zip(regions, deltas)])
    finally:
        shutdown(regions)
    assert_identical(results)
    assert all(r.consistent and r.group_size == 3 for r in results)

    def norm(tensors):
        return float(torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in tensors.values()])))
    assert norm(results[0].averaged) <= 2 * max(norm(deltas[0]), norm(deltas[1]))
    for result in results:
        assert list(result.clipped) == ["r2"] and result.clipped["r2"] < 0.01, result.clipped
