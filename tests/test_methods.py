"""The compressed outer methods' parts against hand-written references on small tensors (ray_diloco.methods).

* top-k by chunk, with the padded last chunk; 2-bit quantization, its scale and table worked out by hand, and the
  packing of the codes byte by byte; the DCT's basis by hand, its round trip, and the fixed-order inverse;
* the error-feedback identity (sent + residual = input) for both methods;
* three rounds of SparseLoCo's Algorithm 1 for two regions, written out in NumPy loops, against the Compressor:
  the same payload sizes, the same error buffers and the same aggregate;
* one round of the DCT method written out in NumPy (the cosine sums by hand): the k largest coefficients are sent;
* a payload from anyone is checked field by field before use: every malformed one is refused, including one
  that is finite on the wire but would decode to inf;
* the config and the CLI flags.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ray_diloco.cli import build_parser, apply_flags
from ray_diloco.config import ConfigError, OuterConfig
from ray_diloco.methods import dct
from ray_diloco.methods.chunks import from_chunks, to_chunks, top_k_per_chunk
from ray_diloco.methods.compressors import Compressor
from ray_diloco.methods.quantize import dequantize, pack_codes, quantize, unpack_codes
from ray_diloco.methods.settings import MethodSettings
from ray_diloco.presets import tiny_cpu

SHAPES = {"w": (5, 12), "b": (7,)}


def test_top_k_by_chunk_pads_the_last_chunk_and_lists_indices_in_order():
    x = torch.tensor([1.0, -5.0, 3.0, 0.5, 2.0, 2.5, -0.25, 4.0, -7.0, 0.5])
    chunks = to_chunks(x, 4)
    assert chunks.tolist() == [[1, -5, 3, 0.5], [2, 2.5, -0.25, 4], [-7, 0.5, 0, 0]]
    assert top_k_per_chunk(chunks, 2).tolist() == [[1, 2], [1, 3], [0, 1]]
    assert torch.equal(from_chunks(chunks, x.shape), x)
    with pytest.raises(ValueError, match="k must lie"):
        top_k_per_chunk(chunks, 5)


def test_two_bit_quantization_by_hand():
    # μ = 1, centred [-4, -2, -1, 0, 2, 5], σ = √(50/5) = √10, step = 6σ/4; codes round(c/step + 2)
    codes, table = quantize(torch.tensor([-3.0, -1.0, 0.0, 1.0, 3.0, 6.0]), bits=2)
    assert codes.tolist() == [1, 2, 2, 2, 2, 3]
    step = 1.5 * math.sqrt(10)
    assert table.tolist() == pytest.approx([1 - 2 * step, -3.0, 0.75, 6.0])  # bin 0 empty: its centre
    assert dequantize(codes, table).tolist() == pytest.approx([-3, 0.75, 0.75, 0.75, 0.75, 6])
    packed = pack_codes(codes, 2)
    assert list(packed) == [1 | 2 << 2 | 2 << 4 | 2 << 6, 2 | 3 << 2]
    assert unpack_codes(packed, 6, 2).tolist() == codes.tolist()
    with pytest.raises(ValueError, match="expected 2"):
        unpack_codes(packed + b"\0", 6, 2)
    equal_codes, equal_table = quantize(torch.full((3,), 0.5), bits=2)  # σ = 0: no division by zero
    assert dequantize(equal_codes, equal_table).tolist() == [0.5] * 3


def test_the_dct_basis_by_hand_its_round_trip_and_the_fixed_order_inverse():
    r = 1 / math.sqrt(2)
    assert dct.dct_basis(2).reshape(-1).tolist() == pytest.approx([r, r, r, -r])
    assert dct.forward(torch.tensor([[3.0, 1.0]])).tolist()[0] == pytest.approx([4 * r, 2 * r])
    basis = dct.dct_basis(64)
    assert torch.allclose(basis @ basis.T, torch.eye(64), atol=1e-6)  # orthonormal
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(dct.inverse(dct.forward(x)), x, atol=1e-5)
    coefficients = dct.forward(x)
    exact = dct.inverse_exact(coefficients)
    reference = coefficients.double() @ basis.double()
    assert torch.allclose(exact.double(), reference, atol=1e-5)
    threads = torch.get_num_threads()
    try:  # the same bits whatever the thread count (a matrix product gives no such promise)
        torch.set_num_threads(1)
        assert torch.equal(dct.inverse_exact(coefficients), exact)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("method", ["sparseloco", "dct"])
def test_error_feedback_sent_plus_residual_is_the_input(method):
    settings = MethodSettings(method, 16 if method == "sparseloco" else 8, 3, 2, 0.9)
    compressor = Compressor(settings, SHAPES)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        before = {n: compressor.state.get(n) for n in SHAPES}
        delta = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
        _, sent = compressor.compress(delta)
        for name, shape in SHAPES.items():
            buffer = to_chunks(delta[name], settings.chunk_size)
            if before[name] is not None:
                buffer = before[name] * 0.9 + buffer
            residual = from_chunks(compressor.state[name], shape)
            assert torch.allclose(sent[name] + residual, from_chunks(buffer, shape), atol=1e-6)
            if method == "sparseloco":  # only the selected values moved; the rest is exactly the buffer
                unsent = sent[name] == 0
                assert torch.equal(residual[unsent], from_chunks(buffer, shape)[unsent])
                assert int((sent[name] != 0).sum()) <= 3 * math.ceil(math.prod(shape) / 16)


def reference_quantize(values: np.ndarray) -> np.ndarray:
    """SparseLoCo's 2-bit quantizer, written out: four bins over 6σ around the mean, each read as its mean."""
    mean = values.mean()
    centred = values - mean
    step = 6 * centred.std(ddof=1) / 4
    codes = np.clip(np.round(centred / step + 2), 0, 3)
    return np.array([mean + centred[codes == c].mean() for c in codes], dtype=np.float64)


def reference_round(error: dict, delta: dict, chunk: int, k: int, beta: float):
    """One region's round of SparseLoCo's Algorithm 1 in loops: e ← βe + Δ; top-k |e| per chunk; quantize the
    tensor's selected values; e ← e − sent. Returns (sent, new error) by name, float64."""
    sent_all, new_error = {}, {}
    for name, d in delta.items():
        flat = d.double().numpy().reshape(-1)
        e = beta * error.get(name, np.zeros_like(flat)) + flat
        selected = []
        for start in range(0, len(flat), chunk):
            piece = list(range(start, min(start + chunk, len(flat))))
            piece.sort(key=lambda i: -abs(e[i]))
            selected += sorted(piece[:k])
        sent = np.zeros_like(flat)
        sent[selected] = reference_quantize(e[selected])
        sent_all[name], new_error[name] = sent, e - sent
    return sent_all, new_error


def test_three_rounds_of_sparseloco_match_algorithm_1_written_out():
    settings = MethodSettings("sparseloco", 12, 4, 2, 0.95)  # 12 divides both tensors' sizes: no padding
    shapes = {"w": (5, 12), "b": (12,)}
    regions = {"a": Compressor(settings, shapes), "b": Compressor(settings, shapes)}
    errors = {"a": {}, "b": {}}
    tokens = {"a": 300, "b": 100}
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        payloads, expected_mean = [], {n: 0.0 for n in SHAPES}
        for region, compressor in regions.items():
            delta = {n: torch.randn(s, generator=g) * 0.1 for n, s in shapes.items()}
            payload, _ = compressor.compress(delta)
            sent, errors[region] = reference_round(errors[region], delta, 12, 4, 0.95)
            for name in SHAPES:
                assert np.allclose(compressor.state[name].numpy().reshape(-1), errors[region][name], atol=1e-6)
                expected_mean[name] = expected_mean[name] + tokens[region] / 400 * sent[name]
            payloads.append((tokens[region], payload))
        averaged = regions["a"].aggregate(payloads)
        assert torch.equal(averaged["w"], regions["b"].aggregate(payloads)["w"])  # both regions decode alike
        for name in SHAPES:
            assert np.allclose(averaged[name].double().numpy().reshape(-1), expected_mean[name], atol=1e-6)


def corrupt(payload: bytes, offset: int, value: bytes) -> bytes:
    return payload[:offset] + value + payload[offset + len(value):]


@pytest.mark.parametrize("method", ["sparseloco", "dct"])
def test_a_malformed_payload_is_refused_before_use(method):
    settings = MethodSettings(method, 6, 2, 2, 0.9)  # chunks of 6: 3-bit indices, of which 6 and 7 are out of range
    compressor = Compressor(settings, SHAPES)
    payload, _ = compressor.compress({n: torch.randn(s) for n, s in SHAPES.items()})
    assert len(payload) == compressor.payload_bytes()
    compressor.decode_payload(payload)  # the sound one passes
    # The header is 6 bytes; "b" (7 values: two chunks, four 3-bit indices in 2 bytes) sorts first, then its values.
    first_values = 6 + 2
    bad = {
        "short": payload[:-1], "long": payload + b"\0", "magic": corrupt(payload, 0, b"XXXX"),
        "index out of range": corrupt(payload, 6, bytes([payload[6] | 0b11100000])),  # the first index 7
        "indices not increasing": corrupt(payload, 6, bytes([0, 0])),  # every index 0
        "non-finite": corrupt(payload, first_values, np.float32(np.nan).tobytes()),
        # finite on the wire, inf once decoded: a level of 1e38 (sparseloco) or a scale of 1e-45 (dct)
        "decodes beyond the bound": corrupt(payload, first_values,
                                            np.float32(1e38 if method == "sparseloco" else 1e-45).tobytes()),
    }
    if method == "dct":
        bad["scale not a power of two"] = corrupt(payload, first_values, np.float32(3.0).tobytes())
    for what, data in bad.items():
        with pytest.raises(ValueError):
            compressor.decode_payload(data)
        with pytest.raises(ValueError):
            compressor.aggregate([(1, payload), (1, data)])
    if method == "dct":  # the fp16 values themselves
        with pytest.raises(ValueError, match="non-finite"):
            compressor.decode_payload(corrupt(payload, first_values + 4, np.float16(np.inf).tobytes()))


def test_the_state_round_trips_and_a_state_of_another_model_is_refused():
    compressor = Compressor(MethodSettings("dct", 8, 2, 2, 0.9), SHAPES)
    compressor.compress({n: torch.randn(s) for n, s in SHAPES.items()})
    other = Compressor(MethodSettings("dct", 8, 2, 2, 0.9), SHAPES)
    other.load_state_dict(compressor.state_dict())
    delta = {n: torch.randn(s) for n, s in SHAPES.items()}
    assert compressor.compress(delta)[0] == other.compress(delta)[0]
    with pytest.raises(ValueError, match="does not fit"):
        other.load_state_dict({"w": torch.zeros(3, 8)})


def test_config_and_flags_of_the_outer_method():
    with pytest.raises(ConfigError, match="outer.momentum: dct takes a plain SGD step"):
        OuterConfig(method="dct")
    with pytest.raises(ConfigError, match="outer.method: must be one of"):
        OuterConfig(method="zip")
    with pytest.raises(ConfigError, match="outer.topk"):
        OuterConfig(method="sparseloco", momentum=0, nesterov=False, topk=5000)
    # The flag the user typed is named, not the config field it sets.
    with pytest.raises(ConfigError, match="^--topk: only sparseloco and dct select"):  # not ignored silently
        apply_flags(tiny_cpu(), build_parser().parse_args(["train", "--topk", "5"]))
    with pytest.raises(ConfigError, match=r"^--topk: must lie in \[1, chunk_size=64\]"):
        apply_flags(tiny_cpu(), build_parser().parse_args(["train", "--outer-method", "dct", "--topk", "100"]))
    args = build_parser().parse_args(["train", "--outer-method", "sparseloco", "--topk", "41"])
    outer = apply_flags(tiny_cpu(), args).outer
    assert (outer.method, outer.momentum, outer.nesterov, outer.lr, outer.topk) == ("sparseloco", 0, False, 1.0, 41)
    args = build_parser().parse_args(["train", "--outer-method", "dct", "--outer-lr", "0.5"])
    assert apply_flags(tiny_cpu(), args).outer.lr == 0.5
    with pytest.raises(ConfigError, match="--outer-lr: must be > 0"):
        apply_flags(tiny_cpu(), build_parser().parse_args(["train", "--outer-lr", "0"]))


def reference_dct_round(delta: np.ndarray, chunk: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The DCT method's first round (m = Δ) for one 1-D tensor, written out: coefficients by the cosine sums, the k
    largest |c| of each chunk kept, the chunk rebuilt from them. Returns (sent, residual), float64."""
    n = np.arange(chunk)
    sent = np.zeros_like(delta)
    for start in range(0, len(delta), chunk):
        x = delta[start:start + chunk]
        c = np.array([math.sqrt((1 if f == 0 else 2) / chunk) * np.sum(x * np.cos(np.pi * (2 * n + 1) * f / (2 * chunk)))
                      for f in range(chunk)])
        keep = np.argsort(-np.abs(c))[:k]
        kept = np.zeros(chunk)
        kept[keep] = c[keep]
        sent[start:start + chunk] = [sum(math.sqrt((1 if f == 0 else 2) / chunk) * kept[f]
                                         * math.cos(math.pi * (2 * i + 1) * f / (2 * chunk)) for f in range(chunk))
                                     for i in range(chunk)]
    return sent, delta - sent


def test_one_round_of_the_dct_method_sends_the_largest_coefficients_written_out():
    delta = torch.randn(48, generator=torch.Generator().manual_seed(5))
    compressor = Compressor(MethodSettings("dct", 16, 3, 2, 0.9), {"v": (48,)})
    payload, sent = compressor.compress({"v": delta})
    expected_sent, expected_residual = reference_dct_round(delta.double().numpy(), 16, 3)
    assert np.allclose(sent["v"].double().numpy(), expected_sent, atol=2e-3)  # fp16 values on the wire
    assert np.allclose(compressor.state["v"].double().numpy().reshape(-1), expected_residual, atol=2e-3)
    assert np.allclose(compressor.aggregate([(1, payload)])["v"].double().numpy(), expected_sent, atol=2e-3)


def test_the_start_line_describes_each_outer_method():
    from ray_diloco.config import OuterConfig
    from ray_diloco.methods.settings import describe_outer

    assert describe_outer(OuterConfig(inner_steps=50)) == \
        "outer diloco: H=50, Δ on a scaled-fp16 wire, token-weighted mean, Nesterov lr 0.7 momentum 0.9"
    dct = OuterConfig(method="dct", momentum=0, nesterov=False, lr=1.0, topk=4, aggregation="clipped")
    assert describe_outer(dct) == \
        "outer dct: H=20, top-4 of 64 DCT coefficients per chunk, fp16, clipped at 2.0× the median norm, SGD lr 1.0"


def test_indices_pack_in_the_bits_their_chunk_needs_by_hand():
    from ray_diloco.methods.bitpack import index_bits, pack_uints, packed_size, unpack_uints

    assert [index_bits(n) for n in (1, 2, 6, 64, 65, 4096)] == [1, 1, 3, 6, 7, 12]
    # 1 and 4095 in 12 bits each: 0000 0000 0001 | 1111 1111 1111 -> 0x00 0x1f 0xff
    assert pack_uints(np.array([1, 4095]), 12) == bytes([0x00, 0x1F, 0xFF])
    # 5, 0, 7 in 3 bits: 101 000 111, padded with zeros -> 1010 0011 | 1000 0000
    assert pack_uints(np.array([5, 0, 7]), 3) == bytes([0b10100011, 0b10000000])
    values = np.random.default_rng(0).integers(0, 4096, size=1001)
    packed = b"xy" + pack_uints(values, 12)
    assert len(packed) == 2 + packed_size(1001, 12) == 2 + 1502
    assert np.array_equal(unpack_uints(packed, 2, 1001, 12), values)
    with pytest.raises(ValueError, match="do not fit in 12 bits"):
        pack_uints(np.array([4096]), 12)
    with pytest.raises(ValueError, match="do not fit in 32 bits"):
        pack_uints(np.array([-1, 2**32]), 32)  # no wrap-around through the unsigned cast
    with pytest.raises(ValueError, match="bits must lie"):
        unpack_uints(packed, 2, 1, 0)
    with pytest.raises(ValueError, match="bytes left"):
        unpack_uints(packed[:-1], 2, 1001, 12)


def test_a_sparseloco_payload_of_one_percent_is_under_0_15_bit_per_parameter():
    """SparseLoCo's defaults at 1 % (41 of 4096 per chunk): 12-bit indices and 2-bit values are 574 bits per 4096
    parameters, 0.140 bit; plus each tensor's 4-entry table and the header."""
    shapes = {"w": (4096 * 64,)}
    compressor = Compressor(MethodSettings("sparseloco", 4096, 41, 2, 0.95), shapes)
    assert compressor.payload_bytes() == 6 + 64 * 41 * 12 // 8 + 4 * 4 + 64 * 41 * 2 // 8
    assert 8 * compressor.payload_bytes() / (4096 * 64) < 0.15
