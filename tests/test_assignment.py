"""`kernels.linear_assignment` (batched Hungarian matching, a lazy MLX operation) against scipy's
`linear_sum_assignment` on each image's block."""

from kernels import assignment, linear_assignment, native

import mlx.core as mx
import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

needs_native = pytest.mark.skipif(native.missing() is not None, reason=f"{native.missing()}")


def scipy_reference(cost, sizes):
    query_of_target, start = np.zeros(sum(sizes), np.int32), 0
    for image, n in enumerate(sizes):
        queries, targets = linear_sum_assignment(cost[image, :, start : start + n])
        query_of_target[start + targets] = queries
        start += n
    return query_of_target


@pytest.mark.parametrize("sizes,queries", [([3, 0, 7], 20), ([5, 5], 5), ([1], 1), ([0, 0], 4), ([40, 12], 300)])
@pytest.mark.parametrize("how", ["native", "scipy"])
def test_assignment_matches_scipy(sizes, queries, how, rng):
    if how == "native" and native.missing():
        pytest.skip(native.missing())
    cost = rng.standard_normal((len(sizes), queries, sum(sizes))).astype(np.float32) * 3
    if how == "native":
        got = np.array(linear_assignment(mx.array(cost), sizes))
    else:
        got = assignment._scipy_assignment(cost, sizes)
    np.testing.assert_array_equal(got, scipy_reference(cost, sizes))


@needs_native
def test_assignment_of_detr_costs_matches_scipy(rng):
    """Costs with the structure of DETR's (few distinct values on a coarse grid, so near-ties):
    the assignment may differ only where the total cost is the same."""
    sizes, queries = [6, 9], 30
    cost = np.round(rng.uniform(0, 4, (2, queries, 15)), 1).astype(np.float32)
    got = np.array(linear_assignment(mx.array(cost), sizes))
    want = scipy_reference(cost, sizes)
    total = lambda q: sum(cost[0 if t < 6 else 1, q[t], t] for t in range(15))  # noqa: E731
    assert total(got) == pytest.approx(total(want), abs=1e-5)
    for start, n in [(0, 6), (6, 9)]:
        assert len(set(got[start : start + n])) == n  # one-to-one


@needs_native
def test_assignment_is_lazy_and_compiles(rng):
    """mx.compile refuses any evaluation inside; the op runs there and gives scipy's answer."""
    cost = rng.standard_normal((2, 8, 5)).astype(np.float32)
    compiled = mx.compile(lambda c: linear_assignment(c * 2.0, [2, 3]))
    np.testing.assert_array_equal(np.array(compiled(mx.array(cost))), scipy_reference(cost, [2, 3]))


@needs_native
def test_assignment_of_non_finite_costs_still_matches(rng):
    cost = rng.standard_normal((1, 6, 3)).astype(np.float32)
    cost[0, 2, 1] = np.nan
    cost[0, 4, :] = np.inf
    got = np.array(linear_assignment(mx.array(cost), [3]))
    assert len(set(got)) == 3 and 2 not in got[1:2] and 4 not in got


def test_assignment_refuses_more_targets_than_queries():
    with pytest.raises(ValueError, match="7 targets and there are 5 queries"):
        linear_assignment(mx.zeros((1, 5, 7)), [7])
    with pytest.raises(ValueError, match=r"expected \(B, Q, T\) with B = 2"):
        linear_assignment(mx.zeros((1, 5, 7)), [3, 4])
