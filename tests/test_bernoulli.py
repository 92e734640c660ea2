"""`kernels.bernoulli16`, dropout's masks: the kept fraction is threshold / 65536 within sampling
error, elements (across and within a random word) are independent, a key gives its mask again and
another key another one, the threads split work and not results, it stays lazy under `mx.compile`,
the MLX-ops path draws with the same probabilities, bad input is refused."""

import sys

import kernels
from kernels import native

import mlx.core as mx
import numpy as np
import pytest

needs_native = pytest.mark.skipif(native.missing() is not None, reason=f"{native.missing()}")
SIZE = 1 << 21


def key(seed: int) -> mx.array:
    return mx.random.key(seed).astype(mx.uint32)


def within_sampling_error(observed: float, probability: float, count: int, sigmas: float = 5.0) -> bool:
    return abs(observed - probability) <= sigmas * np.sqrt(probability * (1 - probability) / count) + 1e-12


def check_distribution(draw):
    for threshold in (1, 6554, 32768, 58982, 65535):
        p = threshold / 65536
        mask = np.array(draw(key(threshold), threshold, (SIZE,)))
        assert within_sampling_error(mask.mean(), p, SIZE), (threshold, mask.mean())
    assert not np.array(draw(key(1), 0, (4099,))).any()
    assert np.array(draw(key(1), 65536, (4099,))).all()


@needs_native
def test_the_kept_fraction_is_the_threshold_over_65536():
    check_distribution(kernels.bernoulli16)


def test_the_mlx_ops_path_keeps_the_same_fraction(monkeypatch):
    monkeypatch.setattr(native, "for_float32", lambda *arrays: None)
    check_distribution(kernels.bernoulli16)


@needs_native
@pytest.mark.parametrize("threshold", [32768, 58982])
@pytest.mark.parametrize("lag", [1, 2, 3, 4, 5, 1024])  # within a 64-bit word, across words, rows apart
def test_elements_are_independent(lag, threshold):
    p = threshold / 65536
    mask = np.array(kernels.bernoulli16(key(7), threshold, (SIZE,)))
    both = (mask[:-lag] & mask[lag:]).mean()
    assert within_sampling_error(both, p * p, SIZE - lag), (lag, both)


@needs_native
def test_a_key_gives_its_mask_again_and_another_key_another():
    first = kernels.bernoulli16(key(3), 58982, (37, 101))
    assert first.shape == (37, 101) and first.dtype == mx.bool_
    assert mx.array_equal(first, kernels.bernoulli16(key(3), 58982, (37, 101))).item()
    other = np.array(kernels.bernoulli16(key(4), 58982, (37, 101)))
    differ = (np.array(first) != other).mean()
    p = 58982 / 65536
    assert within_sampling_error(differ, 2 * p * (1 - p), first.size), differ  # as for independent masks


@needs_native
def test_threads_split_work_not_results(monkeypatch):
    results = []
    for count in (1, 3):
        monkeypatch.setattr(sys.modules["kernels.bernoulli"], "threads", lambda count=count: count)
        results.append(np.array(kernels.bernoulli16(key(5), 40000, (3, 300001))))
    np.testing.assert_array_equal(results[0], results[1])


@needs_native
def test_it_stays_lazy_under_compile():
    @mx.compile
    def dropped(x, k):
        return mx.where(kernels.bernoulli16(k, 32768, x.shape), x * 2, 0)

    x = mx.ones((64, 65))
    got = dropped(x, key(9))  # evaluating inside the compiled function would raise
    np.testing.assert_array_equal(np.array(got), np.where(np.array(kernels.bernoulli16(key(9), 32768, x.shape)), 2, 0))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match=r"threshold 65537 must be in \[0, 65536\]"):
        kernels.bernoulli16(key(0), 65537, (3,))
    with pytest.raises(ValueError, match="key must be two uint32"):
        kernels.bernoulli16(mx.zeros((3,), dtype=mx.uint32), 100, (3,))
