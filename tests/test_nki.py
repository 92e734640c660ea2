"""The NKI kernels (kernels/nki): forward and every gradient against `kernels.ms_deform_attn`, every
layout and flag, on the edge points of the kernels tests. They run under the Neuron simulator
(`nki.simulate`) where the `nki` package imports, and always under `nki_standin`, a numpy stand-in
for exactly the calls they make (a logic check of indexing and tiling, not a simulator)."""

import importlib
import itertools
import sys
from contextlib import contextmanager

import kernels

import mlx.core as mx
import nki_standin
import numpy as np
import pytest
from conftest import to_mx
from edge_cases import ms_inputs, shapes_for

KERNEL_MODULES = ("kernels.nki.ms_deform_attn", "kernels.nki.torch_op")
F32 = dict(rtol=1e-5, atol=1e-5)


def real_nki_reason():
    try:
        import nki  # noqa: F401
    except ImportError as error:
        return (
            "the nki package (Neuron repository, pip.repos.neuron.amazonaws.com; PyPI's nki is a placeholder) "
            f"does not import here: {error}"
        )
    return None


@contextmanager
def nki_kernels(kind):
    """The kernel modules imported against the stand-in or the real `nki`."""
    names = (*KERNEL_MODULES, "nki", "nki.language", "nki.isa")
    saved = {name: sys.modules.pop(name, None) for name in names}
    try:
        if kind == "standin":
            sys.modules.update(nki_standin.modules())
        yield importlib.import_module(KERNEL_MODULES[0])
    finally:
        for name in names:
            sys.modules.pop(name, None)
            if saved[name] is not None:
                sys.modules[name] = saved[name]


@pytest.fixture(params=["standin", "simulate"])
def nki_run(request):
    """run(kernel_name, *arrays, **flags) -> numpy outputs."""
    if request.param == "simulate" and real_nki_reason():
        pytest.skip(real_nki_reason())
    with nki_kernels(request.param) as module:

        def run(name, *args, **flags):
            kernel = getattr(module, name)
            if request.param == "simulate":
                import nki

                return nki.simulate(kernel)(*args, **flags)
            return kernel(*args, **flags)

        yield run


def starts(shapes):
    return tuple(int(s) for s in np.cumsum([0] + [h * w for h, w in shapes])[:-1])


def compare_with_mlx(nki_run, shapes, value, locations, weights, tolerance=F32, **flags):
    """Forward and the three gradients of the NKI kernels and of the MLX-ops path."""
    rng = np.random.default_rng(1)
    b, q, heads = weights.shape[:3]
    cotangent = mx.array(rng.standard_normal((b, q, heads * value.shape[-1])).astype(np.float32))
    cotangent = cotangent.astype(value.dtype)

    def attend(v, locs, w):
        return kernels.ms_deform_attn(v, shapes, None, locs, w, backend="mlx", **flags)

    reference = [attend(value, locations, weights)]
    reference += mx.grad(lambda *a: (attend(*a) * cotangent).astype(mx.float32).sum(), argnums=(0, 1, 2))(
        value, locations, weights
    )
    arrays = [
        np.array(a.astype(mx.float32)).astype(np.float16 if a.dtype == mx.float16 else np.float32)
        for a in (value, locations, weights, cotangent)
    ]
    forward = nki_run("ms_deformable_attention", arrays[0], shapes, starts(shapes), arrays[1], arrays[2], **flags)
    backward = nki_run(
        "ms_deformable_attention_bwd", arrays[3], arrays[0], shapes, starts(shapes), arrays[1], arrays[2], **flags
    )
    names = ["output", "grad_value", "grad_sampling_locations", "grad_attention_weights"]
    for name, got, want in zip(names, [forward, *backward], reference, strict=True):
        assert got.shape == tuple(want.shape), name
        np.testing.assert_allclose(got.astype(np.float32), np.array(want.astype(mx.float32)), **tolerance, err_msg=name)
    return [forward, *backward]


def in_layouts(value, locations, value_layout, locations_layout):
    if value_layout == "BNLC":
        value = value.transpose(0, 2, 1, 3)
    if locations_layout == "B2QHLP":
        locations = locations.transpose(0, 5, 1, 2, 3, 4)
    return value, locations


@pytest.mark.parametrize(
    "value_layout,locations_layout", list(itertools.product(["BLNC", "BNLC"], ["BQHLP2", "B2QHLP"]))
)
@pytest.mark.parametrize("padding,align_corners", list(itertools.product(["zeros", "border"], [False, True])))
def test_nki_kernels_match_mlx_path(nki_run, padding, align_corners, value_layout, locations_layout, rng):
    shapes = shapes_for(align_corners)
    value, locations, weights = ms_inputs(rng, shapes, align_corners, non_finite=False)
    value, locations = in_layouts(value, locations, value_layout, locations_layout)
    results = compare_with_mlx(
        nki_run,
        shapes,
        value,
        locations,
        weights,
        padding_mode=padding,
        align_corners=align_corners,
        value_layout=value_layout,
        sampling_locations_layout=locations_layout,
    )
    assert np.abs(results[2]).max() > 0


def test_nki_tiles_queries_by_128_with_odd_channels(nki_run, rng):
    """130 queries: a full tile and a tile of 2; 71 channels; a 1x1 level."""
    shapes = ((7, 4), (1, 1))
    args = ms_inputs(rng, shapes, False, batch=1, queries=130, heads=2, channels=71, points=3, non_finite=False)
    compare_with_mlx(nki_run, shapes, *args)


def test_nki_half_precision_values(nki_run, rng):
    """float16 in: the gathered rows are float16, sums and the value-gradient buffer float32."""
    shapes = shapes_for(False)
    value, locations, weights = (a.astype(mx.float16) for a in ms_inputs(rng, shapes, False, non_finite=False))
    compare_with_mlx(nki_run, shapes, value, locations, weights, tolerance=dict(rtol=2e-3, atol=2e-3))


def test_nki_align_corners_location_gradient_scales_by_w_minus_1(nki_run):
    """With align_corners a location maps to u * (W - 1): central differences of the forward (in
    float64, through the MLX path) agree with the NKI backward, and would not with the kernel
    library's factor W."""
    shapes = ((4, 6),)
    rng = np.random.default_rng(3)
    value = rng.standard_normal((1, 24, 1, 3))
    locations = rng.uniform(0.1, 0.9, (1, 5, 1, 1, 2, 2))
    weights = rng.uniform(0.5, 1, (1, 5, 1, 1, 2))
    cotangent = rng.standard_normal((1, 5, 3))

    def loss(locs):
        with mx.stream(mx.cpu):
            out = kernels.ms_deform_attn(to_mx(value), shapes, None, to_mx(locs), to_mx(weights), align_corners=True)
            return float((out * to_mx(cotangent)).sum())

    eps = 1e-6
    numeric = np.zeros_like(locations)
    for index in np.ndindex(locations.shape):
        step = np.zeros_like(locations)
        step[index] = eps
        numeric[index] = (loss(locations + step) - loss(locations - step)) / (2 * eps)
    f32 = [a.astype(np.float32) for a in (cotangent, value, locations, weights)]
    _, grad_locations, _ = nki_run(
        "ms_deformable_attention_bwd", f32[0], f32[1], shapes, (0,), f32[2], f32[3], align_corners=True
    )
    np.testing.assert_allclose(grad_locations, numeric, rtol=1e-4, atol=1e-4)
    library_factor = np.array([6 / 5, 4 / 3])  # W / (W - 1), H / (H - 1)
    assert not np.allclose(grad_locations * library_factor, numeric, rtol=1e-2, atol=1e-3)


def test_nki_torch_op_is_a_drop_in_for_the_authors_function(rng):
    torch = pytest.importorskip("torch", reason="the autograd function is PyTorch's")
    from torch_reference import ms_deform_attn_core

    shapes = ((6, 9), (3, 5))
    value, locations, weights = (np.array(a) for a in ms_inputs(rng, shapes, False, non_finite=False))
    with nki_kernels("standin"):
        from kernels.nki.torch_op import MSDeformAttnFunction

        tensors = [torch.tensor(a, requires_grad=True) for a in (value, locations, weights)]
        spatial_shapes = torch.tensor(shapes, dtype=torch.long)
        level_start_index = torch.tensor(starts(shapes), dtype=torch.long)
        out = MSDeformAttnFunction.apply(tensors[0], spatial_shapes, level_start_index, tensors[1], tensors[2], 64)
        cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
        grads = torch.autograd.grad((out * cotangent).sum(), tensors)

    references = [torch.tensor(a, requires_grad=True) for a in (value, locations, weights)]
    expected = ms_deform_attn_core(references[0], shapes, references[1], references[2])
    expected_grads = torch.autograd.grad((expected * cotangent).sum(), references)
    np.testing.assert_allclose(out.detach().numpy(), expected.detach().numpy(), rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)


def test_nki_standin_checks_what_it_claims():
    nl, nisa = nki_standin.language, nki_standin.isa
    with pytest.raises(ValueError, match="more than 128 partitions"):
        nl.ndarray((129, 4), dtype=nl.float32, buffer=nl.sbuf)
    table = nl.ndarray((8,), dtype=nl.float32, buffer=nl.shared_hbm)
    index = nl.ndarray((2, 1), dtype=nl.uint32, buffer=nl.sbuf)
    index.data[:] = 1
    rows = nl.ndarray((2, 2), dtype=nl.float32, buffer=nl.sbuf)
    target = table.ap(pattern=[[2, 2], [1, 2]], vector_offset=index, indirect_dim=0)
    with pytest.raises(ValueError, match="declared unique_indices"):
        nisa.dma_compute(dst=target, srcs=[target, rows], reduce_op=nl.add, unique_indices=True)
    index.data[:] = 4
    with pytest.raises(IndexError, match="outside its tensor"):
        table.ap(pattern=[[2, 2], [1, 2]], vector_offset=index, indirect_dim=0)
    with pytest.raises(ValueError, match="non-integer"):
        nisa.tensor_copy(dst=index, src=rows[:, 0:1])  # NaN-filled: never written
