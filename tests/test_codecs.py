"""Wire codecs (ray_diloco.sync.codecs and their hivemind forms in ray_diloco.sync.wire_codecs), no network.

Checks that:
* the registry is the one list of compressions, and each name has a hivemind wire form;
* every codec (registry and wire form) refuses NaN/inf, naming the count, instead of clamping inf to ±65504
  or passing NaN on;
* scaled-fp16: two regions at Δ=1e5 and one at 0 average to 66,666.67 (fp16's clamp gives 43,669.33); the
  scale is the largest power of two that fits max|x| under 65504; values representable after scaling
  come back exactly, tiny tensors keep fp16's relative precision; decoding is deterministic and the
  hivemind wire form decodes to the registry's values bit for bit, at 4 bytes per part over fp16;
* the fast NaN/inf count equals the element-wise one (overflowing and cancelling sums included).
"""

import math

import pytest
import torch
from hivemind.compression import CompressionInfo
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_diloco.sync.codecs import CODEC_NAMES, CODECS, FP16_MAX, count_nonfinite, get_codec, power_of_two_scale
from ray_diloco.sync.wire_codecs import decode_part, make_wire_codec
from ray_diloco.sync.outer import weighted_average


def test_codec_names_come_from_the_registry_and_each_has_a_wire_form():
    assert CODEC_NAMES == tuple(CODECS) and "scaled-fp16" in CODEC_NAMES
    for name in CODEC_NAMES:
        make_wire_codec(name)
    with pytest.raises(ValueError, match="scaled-fp16"):  # the error lists the choices
        get_codec("int8")


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_non_finite_input_is_refused_by_every_codec(name):
    x = torch.tensor([float("nan"), float("inf"), 1.0, -float("inf"), 2.0])
    with pytest.raises(ValueError, match="3 non-finite"):
        get_codec(name).encode(x)
    with pytest.raises(ValueError, match="3 non-finite"):
        make_wire_codec(name).compress(x, CompressionInfo.from_tensor(x))


def test_scaled_fp16_averages_large_values_without_clamping_bias():
    deltas = [{"x": torch.tensor([1e5])}, {"x": torch.tensor([1e5])}, {"x": torch.tensor([0.0])}]
    weights = [1.0, 1.0, 1.0]
    # Hand-computed: (1e5 + 1e5 + 0) / 3 = 66,666.67. In scaled fp16 1e5 has s = 2^-1 and 50,000 rounds to
    # 49,984 (steps of 32 there), so it decodes to 99,968 and the average is 66,645.33: within 2^-11.
    scaled = weighted_average(deltas, weights, "scaled-fp16")["x"].item()
    assert scaled == pytest.approx(200_000 / 3, rel=2.0 ** -11)
    assert scaled == pytest.approx(2 * 99_968 / 3, rel=1e-7)
    clamped = weighted_average(deltas, weights, "fp16")["x"].item()
    assert clamped == pytest.approx(2 * 65504 / 3, rel=1e-6)  # the bias scaled-fp16 removes


@pytest.mark.parametrize("amax", [65504.0, 65505.0, 1e5, 3.0e38, 1.0, 1e-30, 2.0 ** -40])
def test_scale_is_the_largest_power_of_two_that_fits(amax):
    x = torch.tensor([amax, -amax / 3, 0.0])
    s = power_of_two_scale(x)
    assert math.frexp(s)[0] == 0.5  # a power of two
    scaled_max = float(torch.tensor(amax)) * s  # amax as fp32, as the codec sees it
    assert scaled_max <= FP16_MAX < 2 * scaled_max
    assert power_of_two_scale(torch.zeros(4)) == 1.0


def test_scaled_fp16_is_exact_for_representable_values_and_keeps_small_tensors_precise():
    codec = get_codec("scaled-fp16")
    # Within one tensor, fp16 normals times one power of two: exact after scaling.
    x = torch.tensor([1.5 * 2**20, -3 * 2**10, 2.0**8, 0.0, -1.25 * 2**12, 1.0 + 2**-10])
    assert torch.equal(codec.roundtrip(x), x)
    wire, scale = codec.encode(x)
    assert wire.dtype == torch.float16 and scale == 2.0**-5
    # Far below fp16's range: plain fp16 flushes these to 0, scaled keeps 11 significant bits.
    tiny = torch.tensor([1e-9, -3.3e-9, 7.7e-10])
    assert torch.equal(get_codec("fp16").roundtrip(tiny), torch.zeros(3))
    torch.testing.assert_close(codec.roundtrip(tiny), tiny, rtol=2.0**-11, atol=0)


def test_scaled_fp16_decoding_is_deterministic_and_the_wire_form_matches_the_registry():
    codec = get_codec("scaled-fp16")
    x = torch.randn(1000) * 3e5
    x[7] = 1e-3
    wire, scale = codec.encode(x)
    assert torch.equal(codec.decode(wire, scale), codec.decode(wire.clone(), scale))
    serialized = make_wire_codec("scaled-fp16").compress(x, CompressionInfo.from_tensor(x))
    decoded = decode_part(serialized)
    assert decoded.dtype == torch.float32 and torch.equal(decoded, codec.roundtrip(x))
    assert torch.equal(decode_part(serialized), decoded)  # the same bytes, the same values
    assert len(serialized.buffer) == 2 * x.numel() + 4  # fp16 values, then the fp32 scale
    fp16 = make_wire_codec("fp16").compress(x, CompressionInfo.from_tensor(x))
    assert len(serialized.buffer) - len(fp16.buffer) == 4
    assert codec.wire_bytes({"a": x, "b": torch.zeros(3)}) == 2 * 1003 + 2 * 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1.5, -2.0, 3e38, -3e38, float("nan"), float("inf"), -float("inf")]),
                min_size=1, max_size=40),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
def test_count_nonfinite_equals_the_element_wise_count(values, dtype):
    """The fast path (a finite sum proves there is nothing to count) never hides a NaN/inf, also when finite
    values overflow the sum (3e38 + 3e38) or cancel (inf − inf)."""
    tensor = torch.tensor(values, dtype=torch.float32).to(dtype)
    assert count_nonfinite(tensor) == int((~torch.isfinite(tensor)).sum())


def test_a_received_part_that_decodes_to_nan_or_inf_is_refused():
    """issue 24: a reducer's reply of fp16 NaN, or scaled-fp16 with scale 2^-127 (finite fp16 values divided by
    it overflow to inf), left every region a NaN θ_global with equal digests. Crafted messages, one by one."""
    import numpy as np
    from hivemind.compression import CompressionInfo
    from hivemind.proto import runtime_pb2

    from ray_diloco.sync.wire_codecs import ScaledFloat16WireCompression, check_part, decode_part, make_wire_codec

    part = torch.linspace(-1, 1, 8)
    good = ScaledFloat16WireCompression().compress(part, CompressionInfo.from_tensor(part))
    assert torch.equal(decode_part(good), get_codec("scaled-fp16").decode(*get_codec("scaled-fp16").encode(part)))

    def scaled(values, scale):
        return runtime_pb2.Tensor(compression=good.compression, buffer=np.asarray(values, np.float16).tobytes()
                                  + np.float32(scale).tobytes(), size=[len(values)], dtype="scaled_float16")

    with pytest.raises(ValueError, match="not a power of two"):
        decode_part(scaled([1.0] * 8, 2.0 ** -127))  # 65504 / 2^-127 = inf
    with pytest.raises(ValueError, match="not a power of two"):
        decode_part(scaled([1.0] * 8, 3.0))
    with pytest.raises(ValueError, match="non-finite"):
        decode_part(scaled([float("nan")] + [1.0] * 7, 1.0))
    fp16 = make_wire_codec("fp16").compress(part, CompressionInfo.from_tensor(part))
    nan = runtime_pb2.Tensor()
    nan.CopyFrom(fp16)
    nan.buffer = np.full(8, np.nan, np.float16).tobytes()
    with pytest.raises(ValueError, match="non-finite"):
        decode_part(nan)
    check_part(torch.zeros(8), torch.Size([8]), 3.0, "peer")
    with pytest.raises(ValueError, match=r"shape \(\) for one of \(8,\)"):  # a scalar would broadcast
        check_part(torch.zeros(()), torch.Size([8]), 1.0, "peer")
    for weight in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="weight"):
            check_part(torch.zeros(8), torch.Size([8]), weight, "peer")
    check_part(torch.zeros(8), torch.Size([8]), 1000.0, "peer", max_weight=1000.0)  # the largest region's tokens
    with pytest.raises(ValueError, match=r"weight 1001.0 \(must lie in \(0, 1000\]\)"):
        check_part(torch.zeros(8), torch.Size([8]), 1001.0, "peer", max_weight=1000.0)
