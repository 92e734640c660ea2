"""`Graph`: an ONNX graph written op by op, with the model's weights at hand.

Every op returns the name of its output (or names, for several), so the model parts read as the
MLX code they mirror: `x = g.add(g.linear(x, "transformer.enc_output"), pos)`. Shapes are static
(the canvas is fixed), so the builder keeps no shape bookkeeping: the parts pass the sizes they
know from the config. Standard domain only, opset `OPSET`."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17  # LayerNormalization is 17's; GroupNormalization (18) is decomposed (see normalization.group_norm)


class Graph:
    """Nodes, constants and the weights (this port's names -> float32 numpy arrays, convolutions OHWI)."""

    def __init__(self, weights: dict):
        self.weights = weights
        self.nodes, self.initializers, self.inputs, self.outputs = [], [], [], []
        self._names = set()
        self._constants = {}

    # naming and constants

    def fresh(self, hint: str) -> str:
        name, i = hint, 1
        while name in self._names:
            name, i = f"{hint}_{i}", i + 1
        self._names.add(name)
        return name

    def const(self, value, hint: str = "const", dtype=np.float32) -> str:
        """A constant tensor (an initializer); equal small constants are shared."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes()) if array.size <= 16 else None
        if key is not None and key in self._constants:
            return self._constants[key]
        name = self.fresh(hint)
        self.initializers.append(numpy_helper.from_array(array, name))
        if key is not None:
            self._constants[key] = name
        return name

    def ints(self, values, hint: str = "ints") -> str:
        return self.const(values, hint, np.int64)

    def weight(self, key: str) -> np.ndarray:
        if key not in self.weights:
            raise KeyError(f"{key}: not in the weights")
        return np.asarray(self.weights[key], np.float32)

    # ops

    def op(self, op_type: str, *inputs: str, outputs: int = 1, hint: str | None = None, **attributes):
        names = [self.fresh(hint or op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, **attributes))
        return names[0] if outputs == 1 else names

    def __getattr__(self, op_type: str):
        """g.Add(a, b), g.Relu(x), ...: any standard op by its ONNX name."""
        if not op_type[:1].isupper():
            raise AttributeError(op_type)
        return lambda *inputs, **attributes: self.op(op_type, *inputs, **attributes)

    def reshape(self, x: str, shape) -> str:
        return self.op("Reshape", x, self.ints(list(shape), "shape"))

    def transpose(self, x: str, perm) -> str:
        return self.op("Transpose", x, perm=list(perm))

    def slice(self, x: str, axis: int, start: int, end: int, step: int = 1) -> str:
        return self.op("Slice", x, self.ints([start]), self.ints([end]), self.ints([axis]), self.ints([step]))

    def unsqueeze(self, x: str, axes) -> str:
        return self.op("Unsqueeze", x, self.ints(list(axes), "axes"))

    def squeeze(self, x: str, axes) -> str:
        return self.op("Squeeze", x, self.ints(list(axes), "axes"))

    def concat(self, parts: list, axis: int) -> str:
        return parts[0] if len(parts) == 1 else self.op("Concat", *parts, axis=axis)

    def split(self, x: str, sizes, axis: int) -> list:
        return self.op("Split", x, self.ints(list(sizes), "split"), axis=axis, outputs=len(sizes))

    def sum(self, parts: list) -> str:
        return parts[0] if len(parts) == 1 else self.op("Sum", *parts)

    def scalar(self, value: float) -> str:
        return self.const(value, "scalar")

    # layers with weights

    def linear(self, x: str, prefix: str) -> str:
        """`nn.Linear` of this port (weight (out, in)): x @ weight.T + bias."""
        weight = self.const(self.weight(f"{prefix}.weight").T, f"{prefix}.weight_t")
        return self.Add(self.MatMul(x, weight), self.const(self.weight(f"{prefix}.bias"), f"{prefix}.bias"))

    def layer_norm(self, x: str, prefix: str, eps: float = 1e-5) -> str:
        scale = self.const(self.weight(f"{prefix}.weight"), f"{prefix}.weight")
        bias = self.const(self.weight(f"{prefix}.bias"), f"{prefix}.bias")
        return self.op("LayerNormalization", x, scale, bias, axis=-1, epsilon=eps)

    # the model

    def input(self, name: str, elem_type, shape) -> str:
        self._names.add(name)
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def output(self, x: str, name: str, elem_type, shape):
        """Name the graph output `name` (an Identity from `x`)."""
        self._names.add(name)
        self.nodes.append(helper.make_node("Identity", [x], [name]))
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))

    def model(self, name: str, doc: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, self.inputs, self.outputs, self.initializers)
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="deformable-detr-mlx", doc_string=doc
        )
        model.ir_version = 8  # opset 17's: read by onnxruntime >= 1.13, TensorRT 8.6+
        return model


FLOAT, INT64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
