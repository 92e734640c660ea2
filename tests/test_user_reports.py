"""The two user reports behind the kernels: `sampling_offsets` must learn, and gradient descent
started at an integer translation must move."""

from deformable_detr import MSDeformAttn

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import to_mx
from mlx.utils import tree_flatten

from examples.registration import SIZE, register, sample_grid

torch = pytest.importorskip("torch", reason="PyTorch (the dev extra) is the reference")
torch_reference = pytest.importorskip("torch_reference", reason="PyTorch (the dev extra) is the reference")

SHAPES = ((6, 8), (3, 4))
D_MODEL, HEADS, POINTS = 16, 4, 2


def encoder_reference_points(shapes, batch):
    """Pixel centres of every level, as the encoder uses them: samples land on integer pixels."""
    points = []
    for h, w in shapes:
        ys, xs = np.meshgrid((np.arange(h) + 0.5) / h, (np.arange(w) + 0.5) / w, indexing="ij")
        points.append(np.stack([xs.reshape(-1), ys.reshape(-1)], -1))
    points = np.concatenate(points)[None, :, None, :]
    return np.broadcast_to(points, (batch, points.shape[1], len(shapes), 2)).copy()


def make_case(rng, reference_points="pixel centres"):
    """query, reference points ("pixel centres", random "points" or "boxes"), input, cotangent."""
    length = sum(h * w for h, w in SHAPES)
    query = rng.standard_normal((2, length, D_MODEL))
    source = rng.standard_normal((2, length, D_MODEL))
    if reference_points == "pixel centres":
        ref = encoder_reference_points(SHAPES, 2)
    elif reference_points == "points":
        ref = rng.uniform(0.1, 0.9, (2, length, len(SHAPES), 2))
    else:
        ref = rng.uniform(0.1, 0.9, (2, length, len(SHAPES), 4))
    return query, ref, source, rng.standard_normal((2, length, D_MODEL))


def mlx_module(dtype=mx.float32):
    mx.random.seed(0)
    module = MSDeformAttn(D_MODEL, len(SHAPES), HEADS, POINTS)
    module.set_dtype(dtype)
    return module


def loss_fn(module, query, ref, source, cotangent):
    return (module(query, ref, source, SHAPES) * cotangent).sum()


def test_init_matches_the_authors():
    theirs = torch_reference.MSDeformAttn(D_MODEL, len(SHAPES), HEADS, POINTS)
    ours = mlx_module()
    np.testing.assert_allclose(
        np.array(ours.sampling_offsets.bias), theirs.sampling_offsets.bias.detach().numpy(), atol=1e-6
    )
    for name in (
        "sampling_offsets.weight",
        "attention_weights.weight",
        "attention_weights.bias",
        "value_proj.bias",
        "output_proj.bias",
    ):
        assert not np.array(dict(tree_flatten(ours.parameters()))[name]).any(), name
    limit = np.sqrt(6 / (2 * D_MODEL))  # xavier_uniform
    assert np.abs(np.array(ours.value_proj.weight)).max() <= limit


@pytest.mark.parametrize("reference_points", ["points", "boxes"])
def test_module_matches_the_authors_module(reference_points, rng):
    """Off the pixel grid: on it, float32 rounding of the two routes to pixel coordinates picks
    either one-sided slope."""
    query, ref, source, cotangent = make_case(rng, reference_points)
    ours = mlx_module()
    ours.attention_weights.weight = mx.array(
        rng.standard_normal((HEADS * len(SHAPES) * POINTS, D_MODEL)) * 0.1, dtype=mx.float32
    )
    theirs = torch_reference.MSDeformAttn(D_MODEL, len(SHAPES), HEADS, POINTS)
    params = dict(tree_flatten(ours.parameters()))
    theirs.load_state_dict({k: torch.tensor(np.array(v)) for k, v in params.items()})
    tensors = [torch.tensor(a, dtype=torch.float32) for a in (query, ref, source)]
    out = theirs(*tensors, SHAPES)
    (out * torch.tensor(cotangent, dtype=torch.float32)).sum().backward()

    args = [mx.array(a, dtype=mx.float32) for a in (query, ref, source, cotangent)]
    got = ours(*args[:3], SHAPES)
    np.testing.assert_allclose(np.array(got), out.detach().numpy(), rtol=1e-4, atol=1e-5)
    _, grads = nn.value_and_grad(ours, lambda *a: loss_fn(ours, *a))(*args)
    for name, grad in tree_flatten(grads):
        want = dict(theirs.named_parameters())[name].grad.numpy()
        np.testing.assert_allclose(np.array(grad), want, rtol=1e-3, atol=1e-4, err_msg=name)


@pytest.mark.float64
def test_sampling_offsets_gradient_is_nonzero_at_init_and_equals_finite_differences(rng):
    """Reference points off the pixel grid, so central differences are well defined."""
    query, ref, source, cotangent = (to_mx(a) for a in make_case(rng, "boxes"))
    module = mlx_module(mx.float64)
    _, grads = nn.value_and_grad(module, lambda *a: loss_fn(module, *a))(query, ref, source, cotangent)
    grad = np.array(grads["sampling_offsets"]["weight"])
    assert np.abs(grad).max() > 1e-3

    weight = np.array(module.sampling_offsets.weight)
    eps = 1e-6
    for _ in range(3):
        direction = rng.standard_normal(weight.shape)
        values = []
        for sign in (1, -1):
            module.sampling_offsets.weight = to_mx(weight + sign * eps * direction)
            values.append(loss_fn(module, query, ref, source, cotangent).item())
        numeric = (values[0] - values[1]) / (2 * eps)
        assert float((grad * direction).sum()) == pytest.approx(numeric, rel=1e-6)


def test_sampling_offsets_learn_when_samples_sit_on_pixels(rng):
    """The encoder at init: reference points at pixel centres and integer offsets put every sample
    exactly on a pixel, where a `ceil`-based sampler has a zero gradient."""
    query, ref, source, cotangent = (mx.array(a, dtype=mx.float32) for a in make_case(rng))
    module = mlx_module()
    _, grads = nn.value_and_grad(module, lambda *a: loss_fn(module, *a))(query, ref, source, cotangent)
    grad = np.array(grads["sampling_offsets"]["weight"])
    assert np.isfinite(grad).all()
    assert (np.abs(grad).reshape(HEADS, len(SHAPES), POINTS, 2, D_MODEL).max(-1) > 1e-4).all()


def test_registration_from_integer_translation_reaches_the_shift():
    grid = np.array(sample_grid(mx.zeros((2,))))
    pixels = (grid + 1) / 2 * (SIZE - 1)
    np.testing.assert_allclose(pixels, np.round(pixels), atol=1e-5)  # the start is on the pixel grid

    path, first_grad, _, _ = register(shift=(2.0, 2.0))
    assert np.all(np.abs(first_grad) > 1e-3)
    np.testing.assert_allclose(path[-1], [2.0, 2.0], atol=1e-3)
