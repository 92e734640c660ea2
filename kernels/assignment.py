"""`linear_assignment`: for a batch of cost matrices, the minimum-cost one-to-one assignment of each
image's targets to its queries (as scipy's `linear_sum_assignment` on each image's block).

With `kernels._native` built it is a lazy MLX operation on the CPU stream, so a loss that matches
predictions to targets needs no evaluation inside a differentiated or compiled function. Without it,
the costs are evaluated and scipy solves them (a host synchronisation).
"""

import mlx.core as mx
import numpy as np

from . import native


def linear_assignment(cost: mx.array, sizes) -> mx.array:
    """cost (B, Q, T): the cost of every query of image b against every target of the batch, whose
    targets come in consecutive runs of `sizes` (B counts adding up to T, each at most Q).
    Returns (T,) int32: the query assigned to each target."""
    sizes = [int(n) for n in sizes]
    if cost.ndim != 3 or cost.shape[0] != len(sizes) or sum(sizes) != cost.shape[2]:
        raise ValueError(
            f"linear_assignment: cost has shape {tuple(cost.shape)}; expected (B, Q, T) with B = {len(sizes)} "
            f"images and T = {sum(sizes)} targets (the sum of sizes {sizes})"
        )
    if any(n > cost.shape[1] for n in sizes):
        raise ValueError(
            f"linear_assignment: an image has {max(sizes)} targets and there are {cost.shape[1]} queries; "
            "each target needs a query of its own"
        )
    extension = native.module()
    if extension is not None:
        return extension.linear_assignment(cost, sizes)
    return mx.array(_scipy_assignment(np.array(mx.stop_gradient(cost).astype(mx.float32)), sizes))


def _scipy_assignment(cost: np.ndarray, sizes) -> np.ndarray:
    from scipy.optimize import linear_sum_assignment

    query_of_target = np.zeros(sum(sizes), dtype=np.int32)
    start = 0
    for image, n in enumerate(sizes):
        block = np.nan_to_num(cost[image, :, start : start + n], nan=1e30, posinf=1e30, neginf=-1e30)
        queries, targets = linear_sum_assignment(block)
        query_of_target[start + targets] = queries
        start += n
    return query_of_target
