"""`Linear`: `nn.Linear`, the same parameters and numbers, on `kernels.linear`, which writes the bias
rows that the product starts from on every CPU core (MLX copied them on one, element by element: an
R50 encoder layer's six projections at 800 x 1066 lost about 50 ms to it)."""

import kernels

import mlx.nn as nn


class Linear(nn.Linear):
    def __call__(self, x, dtype=None, residual=None):
        """The product (+ `residual`: a layer's residual addition, oneDNN's post-op where it computes the product),
        in `dtype` where given (a bfloat16 x from `with_relu` gives its float32 back) and oneDNN computes it, else
        in x's."""
        if dtype is not None or residual is not None:
            y = kernels.onednn.linear(x, self.weight, self.get("bias"), dtype=dtype, residual=residual)
            if y is not None:
                return y
        y = kernels.linear(x, self.weight, self.get("bias"))
        return y if residual is None else y + residual

    def with_relu(self, x):
        """relu(self(x)) with the ReLU as the oneDNN product's post-op (one pass less over the result), the
        result bfloat16 where the product runs in bfloat16 (the next product takes it as it is: an FFN's); None
        where oneDNN does not compute it: the caller computes it its own way."""
        return kernels.onednn.linear(x, self.weight, self.get("bias"), relu=True, keep_bfloat16=True)
