"""Image registration with `kernels.grid_sample`: find the translation that moves one Gaussian blob
onto another by gradient descent, starting at the integer translation (0, 0).

At an integer translation every sample lands exactly on a pixel. A bilinear sampler that takes
`upper = ceil(x)` sees a zero-width cell there and returns a zero gradient, so the search never
starts (the `jax.scipy.ndimage.map_coordinates` bug). `kernels.grid_sample` takes
`upper = floor(x) + 1` and returns the one-sided slope instead.

    python examples/registration.py [--output docs/registration.png]
"""

import argparse
from pathlib import Path

from kernels import grid_sample

import mlx.core as mx
import numpy as np

SIZE = 32
SIGMA = 4.0


def gaussian_blob(center, size=SIZE, sigma=SIGMA) -> mx.array:
    """A (1, size, size, 1) image with a Gaussian blob at pixel `center` (x, y)."""
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float32)
    image = np.exp(-((xs - center[0]) ** 2 + (ys - center[1]) ** 2) / (2 * sigma**2))
    return mx.array(image[None, :, :, None])


def sample_grid(translation: mx.array, size=SIZE) -> mx.array:
    """Normalised grid (align_corners=True) that reads pixel p - translation for every pixel p."""
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float32)
    pixels = mx.array(np.stack([xs, ys], -1))[None]  # (1, size, size, 2), x first
    return 2 * (pixels - translation) / (size - 1) - 1


def warp(moving: mx.array, translation: mx.array) -> mx.array:
    return grid_sample(moving, sample_grid(translation), align_corners=True)


def registration_loss(translation, moving, fixed):
    return mx.mean((warp(moving, translation) - fixed) ** 2)


def register(shift=(2.0, 2.0), steps=100, learning_rate=200.0):
    """Register a blob at the centre onto a copy shifted by `shift`, from translation (0, 0).
    Returns the translations visited, the first being (0, 0), and the first gradient."""
    center = SIZE / 2
    moving = gaussian_blob((center, center))
    fixed = gaussian_blob((center + shift[0], center + shift[1]))
    loss_and_grad = mx.value_and_grad(registration_loss)
    translation = mx.zeros((2,))
    path, first_grad = [np.array(translation)], None
    for _ in range(steps):
        _, grad = loss_and_grad(translation, moving, fixed)
        first_grad = np.array(grad) if first_grad is None else first_grad
        translation = translation - learning_rate * grad
        mx.eval(translation)
        path.append(np.array(translation))
    return np.stack(path), first_grad, moving, fixed


def draw(path, moving, fixed, output: Path):
    from PIL import Image, ImageDraw

    def to_image(a):
        return Image.fromarray((np.array(a)[0, :, :, 0] * 255).clip(0, 255).astype(np.uint8)).resize(
            (192, 192), Image.NEAREST
        )

    warped = warp(moving, mx.array(path[-1]))
    panels = [("moving", moving), ("fixed (shifted 2, 2)", fixed), ("moving, registered", warped)]
    canvas = Image.new("RGB", (3 * 202 + 10, 240), "white")
    pen = ImageDraw.Draw(canvas)
    for i, (title, image) in enumerate(panels):
        canvas.paste(to_image(image).convert("RGB"), (10 + 202 * i, 30))
        pen.text((10 + 202 * i, 10), title, fill="black")
    t = path[-1]
    pen.text((10, 228), f"translation from (0, 0) to ({t[0]:.3f}, {t[1]:.3f}) in {len(path) - 1} steps", fill="black")
    output.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(output)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("output/registration.png"))
    args = parser.parse_args()
    path, first_grad, moving, fixed = register()
    print(f"gradient at translation (0, 0): ({first_grad[0]:.5f}, {first_grad[1]:.5f})")
    for step in (0, 10, 50, len(path) - 1):
        print(f"step {step:4d}: translation ({path[step][0]:.4f}, {path[step][1]:.4f})")
    draw(path, moving, fixed, args.output)
    print(f"picture: {args.output}")


if __name__ == "__main__":
    main()
