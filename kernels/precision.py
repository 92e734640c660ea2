"""`bfloat16_products()`: whether bfloat16 products are fast where MLX computes now, and why; the one
answer the model's precision (deformable_detr/models/precision.py), the benchmarks and the tests ask.

Fast: on a GPU (MLX's own bfloat16 kernels), or on the CPU through oneDNN where it has AMX or
AVX512-BF16 kernels for them (onednn.bfloat16_kernels, which asks oneDNN itself). Not fast: a CPU
without those instructions (AVX2 only, or AVX-512 without BF16), or one where oneDNN is not used:
there MLX's CPU bfloat16 products are about 20x slower than its float32 (a 2048^2 product 3.9 s against
0.19 s), and a bfloat16 run would be slower than float32, not faster."""

import mlx.core as mx

from . import onednn


def bfloat16_products() -> tuple[bool, str]:
    """(fast, why): whether bfloat16 products run faster than float32 on the default device, and why."""
    device = mx.default_device()
    if device.type != mx.cpu:
        return True, f"MLX's bfloat16 products on {device}"
    why_not = onednn.bfloat16_kernels()
    if why_not is not None:
        return False, why_not
    return True, f"this CPU has {', '.join(onednn.bfloat16_instructions()) or 'bfloat16 instructions'} (oneDNN)"
