"""How a round combines the regions' contributions (ray_diloco.sync.aggregation), against hand-computed values:

* the lower median, the clip scales, and the clipped mean of three Δ one of which is ×1000;
* under `mean` every scale is 1 and the result is the token-weighted mean;
* a property (hypothesis): under `clipped`, every contribution after its scale and the result itself have a norm of
  at most c × the median norm, whatever one member sends (×10⁶, sign-flipped, zeros);
* a compressed method's aggregate under `clipped` (Compressor.aggregate_decoded): the inflated payload is scaled by
  c × median / its norm, per tensor, and the result is that weighted sum.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_diloco.methods.compressors import Compressor
from ray_diloco.methods.settings import MethodSettings
from ray_diloco.sync.aggregation import clip_scales, combine, lower_median


def test_the_lower_median_and_the_clip_scales():
    assert lower_median([3.0, 1.0, 2.0]) == 2.0
    assert lower_median([4.0, 1.0, 3.0, 2.0]) == 2.0  # even count: the lower middle value
    assert clip_scales([1.0, 2.0, 100.0], factor=2.0) == [1.0, 1.0, 0.04]  # bound 2 × 2 = 4
    assert clip_scales([0.0, 0.0, 5.0], factor=2.0) == [1.0, 1.0, 0.0]  # a median of zero clips the rest to zero


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
