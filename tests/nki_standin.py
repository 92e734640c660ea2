"""A numpy stand-in for exactly the `nki`, `nki.language` and `nki.isa` calls that
`kernels/nki/ms_deform_attn.py` makes: a logic check of its indexing and tiling, not a simulator.

What it checks: on-chip tiles (SBUF) have at most 128 partitions; compute instructions read and
write on-chip tiles only, DMA moves between HBM and SBUF; operands have the shapes the instruction
needs (per-partition scalars are (P, 1)); indirect access patterns stay inside their tensor; an
indirect scatter-add that declares unique indices gets unique indices; integer tiles receive exact
non-negative integers. New tensors are filled with NaN (float) or 4 (int), as the Neuron CPU
simulator does, so a read of something never written shows in the result.

What it does not model: timing, engines, SBUF / PSUM capacity, bfloat16 rounding, hardware
rounding of float-to-int conversion (floor is explicit in the kernels), DMA queue limits.

`modules()` returns the three modules, to put in `sys.modules` under their names before importing
the kernels; `nki.jit` kernels then take and return numpy arrays (or CPU torch tensors).
"""

import types

import numpy as np

PMAX = 128
HBM = ("shared_hbm", "private_hbm", "hbm")
ON_CHIP = ("sbuf", "psum")


class Tensor:
    """An array in one memory (HBM or on-chip)."""

    def __init__(self, data: np.ndarray, buffer: str):
        self.data = data
        self.buffer = buffer

    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype.type)

    def __getitem__(self, key):
        view = self.data[key]
        if not isinstance(view, np.ndarray) or not np.shares_memory(view, self.data):
            raise IndexError(f"index {key!r} does not give a view of a {self.shape} tensor")
        return Tensor(view, self.buffer)

    def __setitem__(self, key, value):
        _on_chip(self, "the destination of an assignment")
        _assign(Tensor(self.data[key], self.buffer), _values(value))

    def reshape(self, shape):
        if self.buffer not in HBM:
            raise ValueError("reshape of an on-chip tile")
        view = self.data.reshape(shape)
        if not np.shares_memory(view, self.data):
            raise ValueError(f"reshape of a non-contiguous {self.shape} tensor")
        return Tensor(view, self.buffer)

    def ap(self, pattern, offset=0, vector_offset=None, indirect_dim=None):
        return AccessPattern(self, pattern, offset, vector_offset, indirect_dim)


class AccessPattern:
    """`tensor.ap(pattern=[[step, count], [step, count]], offset, vector_offset, indirect_dim=0)`
    on a flat HBM tensor: element (i, j) at offset + i * step0 + j * step1, where with a
    vector_offset (a (P, 1) on-chip tile of indices) i is replaced by vector_offset[i]."""

    def __init__(self, tensor, pattern, offset, vector_offset, indirect_dim):
        if tensor.buffer not in HBM or tensor.data.ndim != 1:
            raise ValueError("access patterns here address flat HBM tensors")
        (step0, count0), (step1, count1) = pattern
        first = np.arange(count0)
        if vector_offset is not None:
            if indirect_dim != 0 or vector_offset.shape != (count0, 1):
                raise ValueError(f"vector_offset {vector_offset.shape} for {count0} partitions, indirect_dim 0")
            _on_chip(vector_offset, "an indirect index tile")
            first = vector_offset.data[:, 0].astype(np.int64)
        self.tensor = tensor
        self.offsets = offset + first[:, None] * step0 + np.arange(count1)[None, :] * step1
        self.shape = (count0, count1)
        if (self.offsets < 0).any() or (self.offsets >= tensor.data.size).any():
            raise IndexError(f"access pattern outside its tensor of {tensor.data.size} elements")

    def read(self):
        return self.tensor.data[self.offsets]


def _on_chip(tensor, what):
    if not isinstance(tensor, Tensor) or tensor.buffer not in ON_CHIP:
        raise ValueError(f"{what} must be an on-chip tile")


def _values(source):
    if isinstance(source, AccessPattern):
        return source.read()
    return source.data


def _assign(dst, values):
    """Write values into dst, cast to its dtype; integers must be exact and non-negative."""
    if values.shape != dst.shape:
        raise ValueError(f"shape {values.shape} written into {dst.shape}")
    if np.issubdtype(dst.data.dtype, np.integer):
        if not np.array_equal(values, np.round(values)) or (np.issubdtype(dst.data.dtype, np.unsignedinteger)
                                                            and (values < 0).any()):  # fmt: skip
            raise ValueError(f"non-integer or negative values cast to {dst.data.dtype}")
    dst.data[...] = values.astype(dst.data.dtype)


def _operand(operand, shape):
    """A scalar, or a per-partition (P, 1) tile broadcast along the free dimensions."""
    if isinstance(operand, Tensor):
        _on_chip(operand, "a per-partition operand")
        if operand.shape != (shape[0], 1):
            raise ValueError(f"per-partition operand {operand.shape} for data {shape}")
        return operand.data.astype(np.float32).reshape((shape[0],) + (1,) * (len(shape) - 1))
    return np.float32(operand)


def _compute(dst, data_shape):
    _on_chip(dst, "the destination of a compute instruction")
    if dst.shape != data_shape:
        raise ValueError(f"compute result {data_shape} into {dst.shape}")


def _f32(tile):
    _on_chip(tile, "a compute operand")
    return tile.data.astype(np.float32)


def _apply(op, a, b):
    result = op(a, b)
    return result.astype(np.float32) if result.dtype == bool else result


# --- nki.language ----------------------------------------------------------------------------


def ndarray(shape, dtype, buffer):
    shape = tuple(shape)
    if buffer in ON_CHIP and shape[0] > PMAX:
        raise ValueError(f"on-chip tile {shape}: more than {PMAX} partitions")
    fill = np.nan if np.issubdtype(dtype, np.floating) else 4
    return Tensor(np.full(shape, fill, dtype=dtype), buffer)


def floor(x, dtype=None):
    out = np.floor(_f32(x))
    return Tensor(out.astype(dtype or x.dtype), "sbuf")


language = types.ModuleType("nki.language")
language.__dict__.update(
    ndarray=ndarray,
    floor=floor,
    tile_size=types.SimpleNamespace(pmax=PMAX),
    shared_hbm="shared_hbm",
    private_hbm="private_hbm",
    sbuf="sbuf",
    psum="psum",
    float32=np.float32,
    float16=np.float16,
    int32=np.int32,
    uint32=np.uint32,
    add=np.add,
    subtract=np.subtract,
    multiply=np.multiply,
    maximum=np.maximum,
    minimum=np.minimum,
    equal=np.equal,
    greater=np.greater,
    less=np.less,
)


# --- nki.isa ---------------------------------------------------------------------------------


def dma_copy(dst, src):
    for side in (dst, src):
        if isinstance(side, Tensor) and side.buffer not in HBM + ON_CHIP:
            raise ValueError(f"unknown memory {side.buffer}")
    if not any(isinstance(s, AccessPattern) or s.buffer in HBM for s in (dst, src)):
        raise ValueError("dma_copy between two on-chip tiles")
    values = _values(src)
    if isinstance(dst, AccessPattern):
        if values.shape != dst.shape:
            raise ValueError(f"dma of {values.shape} into an access pattern of {dst.shape}")
        dst.tensor.data[dst.offsets] = values.astype(dst.tensor.data.dtype)
    else:
        if values.dtype != dst.data.dtype:
            raise ValueError(f"dma_copy does not convert: {values.dtype} into {dst.data.dtype}")
        _assign(dst, values)


def dma_compute(dst, srcs, reduce_op, unique_indices=True):
    """dst = reduce_op(srcs...); here the scatter-add form: srcs = [dst, contribution]."""
    if reduce_op is not np.add or len(srcs) != 2 or srcs[0] is not dst or not isinstance(dst, AccessPattern):
        raise ValueError("the stand-in has dma_compute as an indirect scatter-add only")
    if unique_indices and len(np.unique(dst.offsets)) != dst.offsets.size:
        raise ValueError("dma_compute declared unique_indices but two partitions address the same element")
    contribution = _f32(srcs[1])
    if contribution.shape != dst.shape:
        raise ValueError(f"scatter of {contribution.shape} through an access pattern of {dst.shape}")
    np.add.at(dst.tensor.data, dst.offsets, contribution.astype(dst.tensor.data.dtype))


def memset(dst, value):
    _compute(dst, dst.shape)
    dst.data[...] = value


def tensor_copy(dst, src):
    _compute(dst, src.shape)
    _assign(dst, _f32(src) if np.issubdtype(src.dtype, np.floating) else src.data)


def tensor_scalar(dst, data, op0, operand0, op1=None, operand1=None):
    _compute(dst, data.shape)
    result = _apply(op0, _f32(data), _operand(operand0, data.shape))
    if op1 is not None:
        result = _apply(op1, result, _operand(operand1, data.shape))
    _assign(dst, result)


def tensor_tensor(dst, data1, data2, op):
    if data1.shape != data2.shape:
        raise ValueError(f"tensor_tensor of {data1.shape} and {data2.shape}")
    _compute(dst, data1.shape)
    _assign(dst, _apply(op, _f32(data1), _f32(data2)))


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1):
    """dst = (data op0 operand0) op1 operand1, operand1 a tile of data's shape."""
    if operand1.shape != data.shape:
        raise ValueError(f"scalar_tensor_tensor of {data.shape} and {operand1.shape}")
    _compute(dst, data.shape)
    _assign(dst, _apply(op1, _apply(op0, _f32(data), _operand(operand0, data.shape)), _f32(operand1)))


def tensor_reduce(dst, op, data, axis, keepdims=False):
    if op is not np.add:
        raise ValueError("the stand-in reduces with add only")
    result = _f32(data).sum(axis=tuple(axis), keepdims=keepdims, dtype=np.float32)
    _compute(dst, result.shape)
    _assign(dst, result)


isa = types.ModuleType("nki.isa")
isa.__dict__.update(
    dma_copy=dma_copy,
    dma_compute=dma_compute,
    memset=memset,
    tensor_copy=tensor_copy,
    tensor_scalar=tensor_scalar,
    tensor_tensor=tensor_tensor,
    scalar_tensor_tensor=scalar_tensor_tensor,
    tensor_reduce=tensor_reduce,
)


# --- nki -------------------------------------------------------------------------------------


def jit(kernel):
    """Arrays in (numpy, or CPU torch tensors), arrays out, as the Neuron simulator does."""

    def run(*args, **kwargs):
        torch_in = any(type(a).__module__.startswith("torch") for a in args)
        wrapped = [
            Tensor(np.ascontiguousarray(np.asarray(a.detach() if hasattr(a, "detach") else a)), "shared_hbm")
            if hasattr(a, "shape")
            else a
            for a in args
        ]
        result = kernel(*wrapped, **kwargs)

        def out(tensor):
            array = tensor.data.copy()
            if torch_in:
                import torch

                return torch.from_numpy(array)
            return array

        return tuple(out(r) for r in result) if isinstance(result, tuple) else out(result)

    run.__wrapped__ = kernel
    return run


nki = types.ModuleType("nki")
nki.__dict__.update(jit=jit, language=language, isa=isa)


def modules() -> dict:
    return {"nki": nki, "nki.language": language, "nki.isa": isa}
