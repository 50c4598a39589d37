import pytest

pytest.importorskip("torch")

from kvgroups_cuda import params as P  # noqa: E402


def test_pow2_shifts_encode_log2_or_ff_per_size():
    assert P.pow2_shifts(2048, 128, 16) == 11 | 7 << 8 | 4 << 16
    assert P.pow2_shifts(12, 3, 1) == 0xFF | 0xFF << 8 | 0 << 16
    assert P.pow2_shifts(1, 1, 1) == 0


def test_shift_decoding_matches_division_for_every_power_of_two():
    for n in [1 << i for i in range(20)]:
        shift = P.pow2_shifts(n, 1, 1) & 0xFF
        for k in (0, 1, n - 1, n, 3 * n + 5, 1 << 24):
            assert k >> shift == k // n
