"""`kernels.random_split`: the words of `mx.random.split`, bit for bit, from the C++ operation; and the
dropout masks drawn through it equal to those drawn through MLX's own split."""

import mlx.core as mx
import numpy as np
import pytest

import kernels
from deformable_detr.recompute import Dropout
from kernels import native

needs_extension = pytest.mark.skipif(native.missing() is not None, reason=f"{native.missing()}")


@needs_extension
@pytest.mark.parametrize("seed", [0, 7, 2**31 - 2])
@pytest.mark.parametrize("num", [0, 1, 2, 3, 7, 8, 9, 100_003])  # whole vectors of 8 pairs and the rest
def test_random_split_equals_mlx_split(seed, num):
    key = mx.random.key(seed)
    got = native.module().random_split(key, num)
    want = mx.random.split(key, num)
    assert got.dtype == want.dtype == mx.uint32 and got.shape == want.shape == (num, 2)
    np.testing.assert_array_equal(np.array(got), np.array(want))


@needs_extension
def test_random_split_is_lazy_inside_compile():
    """An MLX operation: it traces into a compiled function (a host call would fail there)."""

    @mx.compile
    def words(key):
        return kernels.random_split(key, 5000)

    key = mx.random.key(3)
    np.testing.assert_array_equal(np.array(words(key)), np.array(mx.random.split(key, 5000)))


def test_dropout_masks_do_not_depend_on_the_extension(monkeypatch):
    """A seeded run draws the same masks with the C++ operation as with MLX's split (the fallback where
    the extension is missing or the device is a GPU)."""
    x = mx.random.normal((3, 50, 64), key=mx.random.key(1))
    dropout = Dropout(0.1)
    dropout.train()

    def dropped():
        mx.random.seed(11)
        return np.array(dropout(x)), np.array(dropout(x, after_relu=True))

    with_extension = dropped()
    monkeypatch.setattr(native, "module", lambda: None)
    without = dropped()
    for got, want in zip(with_extension, without, strict=True):
        np.testing.assert_array_equal(got, want)
    assert (with_extension[0] == 0).mean() == pytest.approx(0.1, abs=0.02)


def test_random_split_refuses_a_bad_key():
    with pytest.raises(ValueError, match=r"random_split: key has dtype int32 and shape \(3,\)"):
        kernels.random_split(mx.zeros((3,), mx.int32), 4)
    with pytest.raises(ValueError, match="num is -1"):
        kernels.random_split(mx.random.key(0), -1)
