"""MXFP4 codec against the OCP MX v1.0 definition, computed independently with Python floats."""
import math

import pytest
import torch

from inference.model.mxfp4 import DequantizedCache, dequantize, mxfp4_matmul, quantize, random_on_grid


def e2m1_reference(code: int) -> float:
    """Decode a 4-bit E2M1 code from its bit fields (sign, 2-bit exponent with bias 1, 1-bit mantissa)."""
    sign = -1.0 if code & 0b1000 else 1.0
    exp = (code >> 1) & 0b11
    man = code & 0b1
    if exp == 0:  # subnormal: 0.m * 2^(1-bias)
        return sign * man * 0.5
    return sign * (1 + man / 2) * 2.0 ** (exp - 1)


def test_reference_table_matches_the_spec_listing():
    listed = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert [e2m1_reference(c) for c in range(16)] == listed


@pytest.mark.parametrize("e", [0, 1, 126, 127, 128, 254])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_every_byte_decodes_as_the_table_says(e, dtype):
    # 256 bytes laid out as 8 rows of 32 bytes = 64 elements = 2 blocks per row, all with scale e.
    packed = torch.arange(256, dtype=torch.int64).to(torch.uint8).reshape(8, 32)
    scale = torch.full((8, 2), e, dtype=torch.uint8)
    got = dequantize(packed, scale, dtype).reshape(-1).tolist()
    expected = []
    for byte in range(256):
        for code in (byte & 0xF, byte >> 4):
            v = e2m1_reference(code)
            exact = math.ldexp(v, e - 127) if v else v
            # the dtype's representation of the exact value (inf where it exceeds the range)
            expected.append(torch.tensor(exact, dtype=torch.float64).to(dtype).item())
    assert len(got) == len(expected) == 512
    for i, (g, x) in enumerate(zip(got, expected)):
        assert g == x and math.copysign(1, g) == math.copysign(1, x), (i, g, x)
    if e in (0, 1, 126, 127, 128):  # nothing overflows: every value is the exact product
        assert all(math.isfinite(g) for g in got)


def test_tiny_scales_are_exact_in_fp32():
    # 2^-127 is subnormal in fp32; 6 * 2^-127 and 0.5 * 2^-127 must still come out exact, not flushed.
    packed = torch.tensor([[0x71, 0xF9] + [0] * 14], dtype=torch.uint8)  # codes 1, 7, 9, 15
    scale = torch.zeros((1, 1), dtype=torch.uint8)
    got = dequantize(packed, scale)[0, :4].tolist()
    assert got == [math.ldexp(0.5, -127), math.ldexp(6, -127), -math.ldexp(0.5, -127), -math.ldexp(6, -127)]
    assert got[0] != 0.0


def test_scale_255_is_nan():
    packed = torch.randint(0, 256, (2, 16), dtype=torch.uint8)
    scale = torch.tensor([[255], [127]], dtype=torch.uint8)
    out = dequantize(packed, scale)
    assert torch.isnan(out[0]).all()
    assert not torch.isnan(out[1]).any()


def test_spec_example_byte():
    packed = torch.zeros((1, 16), dtype=torch.uint8)
    packed[0, 0] = 0x2F
    out = dequantize(packed, torch.tensor([[126]], dtype=torch.uint8))
    assert out[0, :2].tolist() == [-3.0, 0.5]
    assert out[0, 2:].abs().sum() == 0


def test_on_grid_weights_round_trip_bit_exact():
    g = torch.Generator().manual_seed(1)
    packed, scale = random_on_grid(64, 256, g, scale_exponents=(0, 254))
    assert packed.shape == (64, 128) and scale.shape == (64, 8)
    # fp64 holds every value, including those past the fp32 range at e = 253, 254.
    p2, s2 = quantize(dequantize(packed, scale, torch.float64))
    assert torch.equal(p2, packed) and torch.equal(s2, scale)
    # fp32 and bf16 hold every value for e <= 252
    packed, scale = random_on_grid(64, 256, g, scale_exponents=(0, 252))
    for dtype in (torch.float32, torch.bfloat16):
        p2, s2 = quantize(dequantize(packed, scale, dtype))
        assert torch.equal(p2, packed) and torch.equal(s2, scale)


def test_any_on_grid_block_round_trips_in_value():
    # blocks whose largest code is small (e.g. all codes <= 1.5) re-encode with another scale, same values
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 4, (16, 64), generator=g)  # magnitudes 0..1.5, positive
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scale = torch.randint(100, 140, (16, 2), generator=g).to(torch.uint8)
    w = dequantize(packed, scale)
    assert torch.equal(dequantize(*quantize(w)), w)


def nearest_on_grid(v: float, s: float) -> float:
    """Brute force: the grid point of {E2M1 values} * s nearest to v, ties to the even code."""
    best = None
    for code in range(16):
        c = e2m1_reference(code) * s
        key = (abs(c - v), code & 1)
        if best is None or key < best[0]:
            best = (key, c)
    return best[1]


def test_quantize_off_grid_picks_the_nearest_grid_point():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(8, 64, generator=g, dtype=torch.float64) * 0.1
    w[0, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4, dtype=torch.float64)  # ties
    packed, scale = quantize(w)
    deq = dequantize(packed, scale, torch.float64)
    blocks = w.reshape(8, 2, 32)
    for r in range(8):
        for b in range(2):
            amax = blocks[r, b].abs().max().item()
            s = math.ldexp(1.0, int(scale[r, b]) - 127)
            assert amax <= 6 * s and (amax > 3 * s)  # smallest scale that fits the block max
            for j in range(32):
                v = blocks[r, b, j].item()
                q = deq[r, b * 32 + j].item()
                assert q == nearest_on_grid(v, s), (r, b, j, v, q)
                assert abs(q - v) <= amax / 3 / 2 * 2  # at most half the widest step (2 s) <= amax / 3
    # the tie row: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4, 6->6
    assert deq[0, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]


def test_quantize_error_is_bounded_for_random_weights():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(32, 128, generator=g)
    deq = dequantize(*quantize(w))
    amax = w.reshape(32, 4, 32).abs().amax(-1, keepdim=True)
    err = (deq - w).reshape(32, 4, 32).abs()
    assert (err <= amax / 3).all()
    # most weights are far from the block max, where the grid is fine: mean relative error is small
    assert (err.sum() / w.abs().sum()).item() < 0.15


def test_quantize_rejects_bad_shapes_and_values():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 48))
    with pytest.raises(ValueError, match="non-finite"):
        quantize(torch.tensor([[math.inf] + [0.0] * 31]))
    with pytest.raises(ValueError, match="uint8"):
        dequantize(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="covers"):
        dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))


def test_negative_zero_and_zero_blocks():
    w = torch.zeros(1, 64)
    w[0, 1] = -0.0
    packed, scale = quantize(w)
    out = dequantize(packed, scale)
    assert torch.equal(out, w) and math.copysign(1, out[0, 1].item()) == -1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_equals_dequantise_then_matmul(dtype):
    g = torch.Generator().manual_seed(5)
    packed, scale = random_on_grid(48, 96, g, scale_exponents=(118, 126))
    x = torch.randn(2, 5, 96, generator=g).to(dtype)
    reference = x @ dequantize(packed, scale, dtype).T
    on_the_fly = mxfp4_matmul(x, packed, scale)
    cache = DequantizedCache()
    cached = mxfp4_matmul(x, packed, scale, cache=cache)
    cached_again = mxfp4_matmul(x, packed, scale, cache=cache)
    assert on_the_fly.shape == (2, 5, 48) and on_the_fly.dtype == dtype
    assert torch.equal(on_the_fly, reference)
    assert torch.equal(cached, reference) and torch.equal(cached_again, reference)
    assert len(cache) == 1 and cache.nbytes == 48 * 96 * x.element_size()


def test_cache_notices_in_place_updates():
    g = torch.Generator().manual_seed(6)
    packed, scale = random_on_grid(8, 32, g)
    x = torch.randn(3, 32, generator=g)
    cache = DequantizedCache()
    before = mxfp4_matmul(x, packed, scale, cache=cache)
    new_packed, new_scale = random_on_grid(8, 32, g)
    packed.copy_(new_packed)  # what a checkpoint load does to a registered buffer
    after = mxfp4_matmul(x, packed, scale, cache=cache)
    assert torch.equal(after, x @ dequantize(new_packed, scale).T)
    assert not torch.equal(after, before)


def test_matmul_rejects_mismatched_input():
    packed, scale = random_on_grid(8, 64, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="features"):
        mxfp4_matmul(torch.randn(2, 32), packed, scale)
