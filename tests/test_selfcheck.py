"""Fused kernels that cannot fail a user: the first use of each fused kernel instance checks itself
against the MLX-ops path; a kernel whose constructor raises (a compiler's error) or that returns
wrong numbers, forward or backward, is named in one warning and its instance takes the MLX-ops
path. The kernels run on the CPU through the GPU emulator (tests/gpu_emulator.py)."""

import dataclasses
import warnings

import kernels
from kernels import backends, selfcheck
from kernels.selfcheck import KernelSelfCheckWarning

import mlx.core as mx
import numpy as np
import pytest
from edge_cases import ms_inputs, shapes_for
from gpu_emulator import METAL


def forget():
    """Drops every verdict: the next use of each instance checks itself afresh."""
    selfcheck._verdicts.clear()


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    forget()
    monkeypatch.delenv("KERNELS_SELF_CHECK", raising=False)
    monkeypatch.delenv("KERNELS_BACKEND", raising=False)
    yield
    forget()


def with_kernels(monkeypatch, make_kernel=None, wrap=None):
    """The emulated Metal back-end as the automatic choice: its constructor replaced by
    `make_kernel`, or its kernels' calls passed through `wrap(name, template, outputs)`."""
    built = []

    def constructor(**spec):
        built.append(spec["name"])
        if make_kernel is not None:
            return make_kernel(**spec)
        kernel = METAL.make_kernel(**spec)
        if wrap is None:
            return kernel
        return lambda **launch: wrap(spec["name"], dict(launch["template"]), kernel(**launch))

    monkeypatch.setattr(backends, "FUSED", {"metal": dataclasses.replace(METAL, make_kernel=constructor)})
    return built


def attention(rng, dtype=mx.float32, **flags):
    shapes = shapes_for(False)
    value, locations, weights = (a.astype(dtype) for a in ms_inputs(rng, shapes, False))
    cotangent = mx.array(rng.standard_normal((value.shape[0], locations.shape[1], value.shape[2] * value.shape[3])))

    def run(backend=None):
        def attend(v, loc, w):
            return kernels.ms_deform_attn(v, shapes, None, loc, w, backend=backend, **flags)

        outputs, gradients = mx.vjp(attend, [value, locations, weights], [cotangent.astype(dtype)])
        return [np.array(a.astype(mx.float32)) for a in (*outputs, *gradients)]

    return run


def self_check_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, KernelSelfCheckWarning)]


def test_a_good_kernel_passes_and_runs(monkeypatch, rng):
    built = with_kernels(monkeypatch)
    run = attention(rng)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = run()
    assert self_check_warnings(caught) == []
    assert built.count("ms_deform_attn_forward") == 2  # the check's problem, then the call: the kernel ran
    for got, expected in zip(fused, run("mlx"), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_kernel_that_does_not_compile_falls_back_with_one_warning(monkeypatch, rng):
    def compiler_error(**spec):
        raise RuntimeError(
            "[metal::Device] Unable to build metal library from source\nerror: use of undeclared identifier"
        )

    built = with_kernels(monkeypatch, make_kernel=compiler_error)
    run = attention(rng)
    with pytest.warns(KernelSelfCheckWarning) as caught:
        first = run()
    (message,) = self_check_warnings(caught)
    assert message.startswith(
        "kernels: the fused metal kernel of ms_deform_attn (float32, padding zeros, align_corners False, value BLNC, "
        "locations BQHLP2) failed its self-check: it raised RuntimeError: [metal::Device] Unable to build metal "
        "library from source. This instance runs on the MLX-ops path from now on"
    )
    assert "kernels/README.md#when-a-fused-kernel-fails-its-self-check" in message and "\n" not in message
    for got, expected in zip(first, run("mlx"), strict=True):
        np.testing.assert_array_equal(got, expected)  # exactly the MLX-ops path
    tries = len(built)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    assert self_check_warnings(caught) == [] and len(built) == tries  # once a process: not tried again


@pytest.mark.parametrize(
    "broken, says",
    [
        ("ms_deform_attn_forward", "the output differs from the MLX-ops path's by 0.5 of its largest value"),
        ("ms_deform_attn_backward", "the gradient of input 1 differs from the MLX-ops path's"),
    ],
)
def test_a_kernel_with_wrong_numbers_falls_back(broken, says, monkeypatch, rng):
    def wrong(name, template, outputs):
        if name != broken:
            return outputs
        if name == "ms_deform_attn_forward":
            return [outputs[0] * 1.5]
        grad_value, grad_locations, grad_weights = outputs
        return [grad_value, mx.zeros_like(grad_locations), grad_weights]  # a backward that forgot the locations

    with_kernels(monkeypatch, wrap=wrong)
    run = attention(rng)
    with pytest.warns(KernelSelfCheckWarning, match=says):
        got = run()
    for a, b in zip(got, run("mlx"), strict=True):
        np.testing.assert_array_equal(a, b)


def test_each_instance_checks_itself(monkeypatch, rng):
    """A kernel wrong only with border padding: the zeros instance runs fused, the border one falls back."""

    def wrong_with_border(name, template, outputs):
        return [o * 2 for o in outputs] if template["PADDING"] == 1 else outputs

    built = with_kernels(monkeypatch, wrap=wrong_with_border)
    zeros, border = attention(rng, padding_mode="zeros"), attention(rng, padding_mode="border")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zeros()
        border()
        border()
    (message,) = self_check_warnings(caught)
    assert "(float32, padding border, align_corners False" in message
    assert built.count("ms_deform_attn_forward") == 3  # zeros: check + call; border: its check only
    for a, b in zip(border(), border("mlx"), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_settings_skip_the_check_or_force_a_back_end(monkeypatch, rng):
    def wrong(name, template, outputs):
        return [o * 1.5 for o in outputs]

    built = with_kernels(monkeypatch, wrap=wrong)
    run = attention(rng)
    reference = run("mlx")
    monkeypatch.setenv("KERNELS_SELF_CHECK", "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unchecked = run()
    assert self_check_warnings(caught) == [] and not np.allclose(unchecked[0], reference[0])  # used as it is
    monkeypatch.delenv("KERNELS_SELF_CHECK")
    forget()
    monkeypatch.setenv("KERNELS_BACKEND", "metal")  # forced: unchecked too
    assert not np.allclose(run()[0], reference[0])
    monkeypatch.setenv("KERNELS_BACKEND", "mlx")
    before = len(built)
    np.testing.assert_array_equal(run()[0], reference[0])
    assert len(built) == before  # no fused kernel built
    monkeypatch.setenv("KERNELS_BACKEND", "vulkan")
    with pytest.raises(ValueError, match="KERNELS_BACKEND='vulkan': expected one of mlx, metal, cuda, cpu"):
        run()


def test_grid_sample_checks_itself_too(monkeypatch, rng):
    def wrong(name, template, outputs):
        return [outputs[0] + 1] if name == "grid_sample_forward" else outputs

    with_kernels(monkeypatch, wrap=wrong)
    image = mx.array(rng.standard_normal((1, 6, 7, 2)).astype(np.float32))
    grid = mx.array(rng.uniform(-1, 1, (1, 4, 4, 2)).astype(np.float32))
    with pytest.warns(KernelSelfCheckWarning, match=r"fused metal kernel of grid_sample \(float32, padding zeros"):
        got = kernels.grid_sample(image, grid)
    np.testing.assert_array_equal(np.array(got), np.array(kernels.grid_sample(image, grid, backend="mlx")))


def test_the_check_runs_inside_a_differentiated_step_and_a_compiled_one(monkeypatch, rng):
    """The first use is usually inside a training step: the check evaluates its own problem there.
    (The emulator itself cannot run inside mx.compile, so there the kernel is one that fails.)"""
    shapes = shapes_for(False)
    value, locations, weights = ms_inputs(rng, shapes, False)

    def loss(v):
        return kernels.ms_deform_attn(v, shapes, None, locations, weights).sum()

    monkeypatch.setenv("KERNELS_BACKEND", "mlx")
    reference = np.array(mx.grad(loss)(value))
    monkeypatch.delenv("KERNELS_BACKEND")
    built = with_kernels(monkeypatch)
    np.testing.assert_allclose(np.array(mx.grad(loss)(value)), reference, rtol=1e-5, atol=1e-5)
    assert "ms_deform_attn_backward" in built  # checked, then run fused inside mx.grad

    def compiler_error(**spec):
        raise RuntimeError("Unable to build metal library from source")

    forget()
    with_kernels(monkeypatch, make_kernel=compiler_error)
    with pytest.warns(KernelSelfCheckWarning, match="it raised RuntimeError: Unable to build metal library"):
        compiled = mx.compile(mx.grad(loss))(value)
    np.testing.assert_allclose(np.array(compiled), reference, rtol=1e-5, atol=1e-5)
