"""Multi-scale deformable attention as NKI kernels (AWS Trainium), forward and backward.

Signature and layouts of the Neuron kernel library's `ms_deformable_attention` /
`ms_deformable_attention_bwd`; numbers of `kernels.ms_deform_attn` (PyTorch's grid_sample
conventions), including the one place where the library's backward differs: with
`align_corners=True` a location maps to u * (W - 1), so its gradient scales by W - 1 (H - 1), where
the library multiplies by W (H) whatever align_corners is.

Tiling: 128 queries on the partition dimension; heads and points on the free dimension. Per level,
the pixel coordinates, the four bilinear taps, their weights and the value-row index of every
(head, point, tap) are computed for the whole tile at once; each tap's value rows (C_h channels)
are gathered by indirect DMA, one row per partition. The backward scatter-adds the value gradient
with an indirect `dma_compute` (duplicates within a call are declared: two queries of a tile may
read the same pixel) into a float32 buffer.

Indices run on the float32 datapath: L * N_h must stay below 2**24.
"""

from typing import NamedTuple

import nki
import nki.isa as nisa
import nki.language as nl

FP32_EXACT_INT = 1 << 24
VALUE_LAYOUTS = ("BLNC", "BNLC")
LOCATION_LAYOUTS = ("BQHLP2", "B2QHLP")
PADDING_MODES = ("zeros", "border")


class Spec(NamedTuple):
    """The compile-time description of a call."""

    batch: int
    queries: int
    heads: int
    levels: int
    points: int
    channels: int
    length: int
    spatial_shapes: tuple
    level_start_index: tuple
    value_layout: str
    locations_layout: str
    align_corners: bool
    padding_mode: str


@nki.jit
def ms_deformable_attention(
    value,
    spatial_shapes: tuple,
    level_start_index: tuple,
    sampling_locations,
    attention_weights,
    value_layout: str = "BLNC",
    sampling_locations_layout: str = "BQHLP2",
    align_corners: bool = False,
    padding_mode: str = "zeros",
):
    """value BLNC (B, L, N_h, C_h) or BNLC (B, N_h, L, C_h); sampling_locations BQHLP2
    (B, N_q, N_h, N_l, N_p, 2) or B2QHLP (B, 2, N_q, N_h, N_l, N_p), in [0, 1], x first;
    attention_weights (B, N_q, N_h, N_l, N_p). Returns (B, N_q, N_h * C_h) in value's dtype."""
    spec = _spec(
        value,
        spatial_shapes,
        level_start_index,
        attention_weights,
        value_layout,
        sampling_locations_layout,
        align_corners,
        padding_mode,
    )
    heads, points, channels = spec.heads, spec.points, spec.channels
    pmax = nl.tile_size.pmax
    output = nl.ndarray((spec.batch, spec.queries, heads * channels), dtype=value.dtype, buffer=nl.shared_hbm)
    rows = value.reshape((spec.batch * spec.length * heads * channels,))
    for b, q0, q, xs, ys, attention in _query_tiles(spec, sampling_locations, attention_weights):
        total = nl.ndarray((pmax, heads * channels), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=total[0:q], value=0.0)
        gathered = nl.ndarray((pmax, channels), dtype=value.dtype, buffer=nl.sbuf)
        for level in range(spec.levels):
            taps = _level_taps(xs, ys, attention, level, q, spec)
            for tap in taps["taps"]:
                for h in range(heads):
                    for p in range(points):
                        _gather(gathered, rows, tap["index"], h, p, q, channels, _batch_offset(b, spec))
                        own = total[0:q, h * channels : (h + 1) * channels]
                        nisa.scalar_tensor_tensor(
                            dst=own,
                            data=gathered[0:q],
                            op0=nl.multiply,
                            operand0=tap["attended"][0:q, h, p : p + 1],
                            op1=nl.add,
                            operand1=own,
                        )
        result = nl.ndarray((pmax, heads * channels), dtype=value.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=result[0:q], src=total[0:q])
        nisa.dma_copy(dst=output[b, q0 : q0 + q], src=result[0:q])
    return output


@nki.jit
def ms_deformable_attention_bwd(
    grad_output,
    value,
    spatial_shapes: tuple,
    level_start_index: tuple,
    sampling_locations,
    attention_weights,
    value_layout: str = "BLNC",
    sampling_locations_layout: str = "BQHLP2",
    align_corners: bool = False,
    padding_mode: str = "zeros",
):
    """Gradients of `ms_deformable_attention` given grad_output (B, N_q, N_h * C_h). Returns
    (grad_value in value's dtype and layout, grad_sampling_locations float32 in its layout,
    grad_attention_weights in value's dtype)."""
    spec = _spec(
        value,
        spatial_shapes,
        level_start_index,
        attention_weights,
        value_layout,
        sampling_locations_layout,
        align_corners,
        padding_mode,
    )
    heads, levels, points, channels = spec.heads, spec.levels, spec.points, spec.channels
    pmax = nl.tile_size.pmax
    rows = value.reshape((spec.batch * spec.length * heads * channels,))
    grad_rows = _zeros_hbm(spec.batch * spec.length * heads, channels)
    grad_locations = nl.ndarray(sampling_locations.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    grad_weights = nl.ndarray(attention_weights.shape, dtype=value.dtype, buffer=nl.shared_hbm)
    for b, q0, q, xs, ys, attention in _query_tiles(spec, sampling_locations, attention_weights):
        upstream = _load_f32(grad_output[b, q0 : q0 + q], (pmax, heads * channels), q)
        grad_attention = _zeros_tile((pmax, heads, levels, points), q)
        grad_x = _zeros_tile((pmax, heads, levels, points), q)
        grad_y = _zeros_tile((pmax, heads, levels, points), q)
        gathered = nl.ndarray((pmax, channels), dtype=value.dtype, buffer=nl.sbuf)
        product = nl.ndarray((pmax, channels), dtype=nl.float32, buffer=nl.sbuf)
        contribution = nl.ndarray((pmax, channels), dtype=nl.float32, buffer=nl.sbuf)
        dot = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
        scratch = (gathered, product, contribution, dot)
        grads = (grad_attention, grad_x, grad_y)
        for level in range(levels):
            taps = _level_taps(xs, ys, attention, level, q, spec)
            for tap in taps["taps"]:
                for h in range(heads):
                    for p in range(points):
                        _tap_backward(tap, h, p, level, b, q, spec, rows, grad_rows, upstream, scratch, grads)
            # d location = attention * sum over taps of (d tap weight / d pixel) * <grad, value>
            # * d pixel / d location (the clip's gradient times W or W - 1)
            for grad, chain in ((grad_x, taps["chain_x"]), (grad_y, taps["chain_y"])):
                own = grad[0:q, :, level, :]
                nisa.tensor_tensor(dst=own, data1=own, data2=attention[0:q, :, level, :], op=nl.multiply)
                nisa.tensor_tensor(dst=own, data1=own, data2=chain[0:q], op=nl.multiply)
        _store_locations(grad_locations, grad_x, grad_y, b, q0, q, spec)
        weights_out = nl.ndarray((pmax, heads, levels, points), dtype=value.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=weights_out[0:q], src=grad_attention[0:q])
        nisa.dma_copy(dst=grad_weights[b, q0 : q0 + q], src=weights_out[0:q])
    return _grad_value(grad_rows, value), grad_locations, grad_weights


# ---------------------------------------------------------------------------------------------
# helpers, traced into the kernels


def _tap_backward(tap, h, p, level, b, q, spec, rows, grad_rows, upstream, scratch, grads):
    """One tap of one (head, point) for a tile of queries: <grad_output, tap value> into the attention
    weight's and the location's gradients, and the tap's share of grad_output into grad_value's rows."""
    gathered, product, contribution, dot = scratch
    channels = spec.channels
    _gather(gathered, rows, tap["index"], h, p, q, channels, _batch_offset(b, spec))
    own = upstream[0:q, h * channels : (h + 1) * channels]
    # <grad_output, tap value>, reduced over channels
    nisa.tensor_tensor(dst=product[0:q], data1=gathered[0:q], data2=own, op=nl.multiply)
    nisa.tensor_reduce(dst=dot[0:q], op=nl.add, data=product[0:q], axis=(1,), keepdims=True)
    for target, factor in zip(grads, (tap["weight"], tap["dweight_dx"], tap["dweight_dy"]), strict=True):
        column = target[0:q, h, level, p : p + 1]
        nisa.scalar_tensor_tensor(
            dst=column,
            data=dot[0:q],
            op0=nl.multiply,
            operand0=factor[0:q, h, p : p + 1],
            op1=nl.add,
            operand1=column,
        )
    nisa.tensor_scalar(
        dst=contribution[0:q],
        data=own,
        op0=nl.multiply,
        operand0=tap["attended"][0:q, h, p : p + 1],
    )
    _scatter_add(grad_rows, tap["index"], h, p, q, channels, contribution, b, spec)


def _spec(
    value, spatial_shapes, level_start_index, attention_weights, value_layout, locations_layout, align_corners, padding
) -> Spec:
    if value_layout not in VALUE_LAYOUTS or locations_layout not in LOCATION_LAYOUTS or padding not in PADDING_MODES:
        raise ValueError(
            f"ms_deformable_attention: value_layout {value_layout!r}, sampling_locations_layout "
            f"{locations_layout!r}, padding_mode {padding!r}; expected one of {VALUE_LAYOUTS}, "
            f"{LOCATION_LAYOUTS}, {PADDING_MODES}"
        )
    batch, queries, heads, levels, points = attention_weights.shape
    channels = value.shape[3]
    length = value.shape[1] if value_layout == "BLNC" else value.shape[2]
    starts = [0]
    for h, w in spatial_shapes[:-1]:
        starts.append(starts[-1] + h * w)
    if tuple(level_start_index) != tuple(starts) or len(spatial_shapes) != levels:
        raise ValueError(
            f"ms_deformable_attention: level_start_index {tuple(level_start_index)} and spatial_shapes "
            f"{tuple(spatial_shapes)} do not describe the {levels} levels of attention_weights "
            f"(expected starts {tuple(starts)})"
        )
    if length * heads >= FP32_EXACT_INT:
        raise ValueError(f"ms_deformable_attention: L * N_h = {length * heads} rows; indices need fewer than 2**24")
    return Spec(
        batch,
        queries,
        heads,
        levels,
        points,
        channels,
        length,
        tuple(map(tuple, spatial_shapes)),
        tuple(level_start_index),
        value_layout,
        locations_layout,
        bool(align_corners),
        padding,
    )


def _query_tiles(spec, sampling_locations, attention_weights):
    """Per batch and tile of up to 128 queries: (b, q0, q, x tile, y tile, attention tile), the
    tiles float32 (P, N_h, N_l, N_p)."""
    pmax = nl.tile_size.pmax
    for b in range(spec.batch):
        for q0 in range(0, spec.queries, pmax):
            q = min(pmax, spec.queries - q0)
            xs, ys = _load_locations(sampling_locations, b, q0, q, spec)
            shape = (pmax, spec.heads, spec.levels, spec.points)
            yield b, q0, q, xs, ys, _load_f32(attention_weights[b, q0 : q0 + q], shape, q)


def _batch_offset(b, spec):
    return b * spec.length * spec.heads * spec.channels


def _load_f32(source, shape, q):
    """An HBM slice of q partitions -> an SBUF float32 tile."""
    staged = nl.ndarray(shape, dtype=source.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=staged[0:q], src=source)
    tile = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=tile[0:q], src=staged[0:q])
    return tile


def _zeros_tile(shape, q):
    tile = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=tile[0:q], value=0.0)
    return tile


def _load_locations(sampling_locations, b, q0, q, spec):
    """x and y of a query tile as float32 tiles (P, N_h, N_l, N_p)."""
    heads, levels, points = spec.heads, spec.levels, spec.points
    pmax = nl.tile_size.pmax
    if spec.locations_layout == "B2QHLP":
        xs = _load_f32(sampling_locations[b, 0, q0 : q0 + q], (pmax, heads, levels, points), q)
        ys = _load_f32(sampling_locations[b, 1, q0 : q0 + q], (pmax, heads, levels, points), q)
        return xs, ys
    both = _load_f32(sampling_locations[b, q0 : q0 + q], (pmax, heads, levels, points, 2), q)
    xs = nl.ndarray((pmax, heads, levels, points), dtype=nl.float32, buffer=nl.sbuf)
    ys = nl.ndarray((pmax, heads, levels, points), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=xs[0:q], src=both[0:q, :, :, :, 0])
    nisa.tensor_copy(dst=ys[0:q], src=both[0:q, :, :, :, 1])
    return xs, ys


def _store_locations(grad_locations, grad_x, grad_y, b, q0, q, spec):
    heads, levels, points = spec.heads, spec.levels, spec.points
    if spec.locations_layout == "B2QHLP":
        nisa.dma_copy(dst=grad_locations[b, 0, q0 : q0 + q], src=grad_x[0:q])
        nisa.dma_copy(dst=grad_locations[b, 1, q0 : q0 + q], src=grad_y[0:q])
        return
    both = nl.ndarray((nl.tile_size.pmax, heads, levels, points, 2), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=both[0:q, :, :, :, 0], src=grad_x[0:q])
    nisa.tensor_copy(dst=both[0:q, :, :, :, 1], src=grad_y[0:q])
    nisa.dma_copy(dst=grad_locations[b, q0 : q0 + q], src=both[0:q])


def _new(q_shape):
    return nl.ndarray(q_shape, dtype=nl.float32, buffer=nl.sbuf)


def _axis(u, size, q, align_corners, padding_mode, shape):
    """Along one axis of a level `size` pixels long: the lower tap, the fraction, and d pixel /
    d location (the scale times the border clip's gradient: 1 strictly inside (0, size - 1))."""
    scale = float(size - 1) if align_corners else float(size)
    x = _new(shape)
    nisa.tensor_scalar(
        dst=x[0:q], data=u, op0=nl.multiply, operand0=scale, op1=nl.add, operand1=0.0 if align_corners else -0.5
    )
    chain = _new(shape)
    if padding_mode == "border":
        above = _new(shape)
        nisa.tensor_scalar(dst=above[0:q], data=x[0:q], op0=nl.greater, operand0=0.0)
        nisa.tensor_scalar(dst=chain[0:q], data=x[0:q], op0=nl.less, operand0=float(size - 1))
        nisa.tensor_tensor(dst=chain[0:q], data1=chain[0:q], data2=above[0:q], op=nl.multiply)
        nisa.tensor_scalar(dst=chain[0:q], data=chain[0:q], op0=nl.multiply, operand0=scale)
        nisa.tensor_scalar(
            dst=x[0:q], data=x[0:q], op0=nl.maximum, operand0=0.0, op1=nl.minimum, operand1=float(size - 1)
        )
    else:
        nisa.memset(dst=chain[0:q], value=scale)
    # far outside reads nothing either way; bounding keeps floor and the index arithmetic exact
    nisa.tensor_scalar(dst=x[0:q], data=x[0:q], op0=nl.maximum, operand0=-8.0, op1=nl.minimum, operand1=size + 8.0)
    low = _new(shape)
    low[0:q] = nl.floor(x[0:q], dtype=nl.float32)
    fraction = _new(shape)
    nisa.tensor_tensor(dst=fraction[0:q], data1=x[0:q], data2=low[0:q], op=nl.subtract)
    sides = []
    for side in (0, 1):  # taps at low and low + 1
        position = _new(shape)
        nisa.tensor_scalar(dst=position[0:q], data=low[0:q], op0=nl.add, operand0=float(side))
        clamped = _new(shape)
        nisa.tensor_scalar(
            dst=clamped[0:q], data=position[0:q], op0=nl.maximum, operand0=0.0, op1=nl.minimum, operand1=size - 1.0
        )
        inside = _new(shape)
        nisa.tensor_tensor(dst=inside[0:q], data1=clamped[0:q], data2=position[0:q], op=nl.equal)
        weight = _new(shape)
        if side:
            nisa.tensor_tensor(dst=weight[0:q], data1=fraction[0:q], data2=inside[0:q], op=nl.multiply)
        else:
            nisa.tensor_scalar(
                dst=weight[0:q], data=fraction[0:q], op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0
            )
            nisa.tensor_tensor(dst=weight[0:q], data1=weight[0:q], data2=inside[0:q], op=nl.multiply)
        slope = _new(shape)  # d weight / d pixel: +1 for the upper tap, -1 for the lower, 0 outside
        nisa.tensor_scalar(dst=slope[0:q], data=inside[0:q], op0=nl.multiply, operand0=1.0 if side else -1.0)
        sides.append({"position": clamped, "weight": weight, "slope": slope})
    return sides, chain


def _level_taps(xs, ys, attention, level, q, spec):
    """The four taps of every (head, point) of one level, as tiles (P, N_h, N_p): value-row index
    (uint32, within the batch), weight, weight x attention, weight derivatives."""
    heads, points, length = spec.heads, spec.points, spec.length
    height, width = spec.spatial_shapes[level]
    shape = (nl.tile_size.pmax, heads, points)
    columns, chain_x = _axis(xs[0:q, :, level, :], width, q, spec.align_corners, spec.padding_mode, shape)
    rows, chain_y = _axis(ys[0:q, :, level, :], height, q, spec.align_corners, spec.padding_mode, shape)
    taps = []
    for row in rows:
        for column in columns:
            pixel = _new(shape)  # start + y * W + x
            nisa.scalar_tensor_tensor(
                dst=pixel[0:q],
                data=row["position"][0:q],
                op0=nl.multiply,
                operand0=float(width),
                op1=nl.add,
                operand1=column["position"][0:q],
            )
            nisa.tensor_scalar(
                dst=pixel[0:q], data=pixel[0:q], op0=nl.add, operand0=float(spec.level_start_index[level])
            )
            for h in range(heads):  # the value row of (pixel, head) within the batch
                if spec.value_layout == "BLNC":
                    nisa.tensor_scalar(
                        dst=pixel[0:q, h],
                        data=pixel[0:q, h],
                        op0=nl.multiply,
                        operand0=float(heads),
                        op1=nl.add,
                        operand1=float(h),
                    )
                else:
                    nisa.tensor_scalar(dst=pixel[0:q, h], data=pixel[0:q, h], op0=nl.add, operand0=float(h * length))
            index = nl.ndarray(shape, dtype=nl.uint32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=index[0:q], src=pixel[0:q])
            weight, dweight_dx, dweight_dy, attended = _new(shape), _new(shape), _new(shape), _new(shape)
            nisa.tensor_tensor(dst=weight[0:q], data1=column["weight"][0:q], data2=row["weight"][0:q], op=nl.multiply)
            nisa.tensor_tensor(
                dst=dweight_dx[0:q], data1=column["slope"][0:q], data2=row["weight"][0:q], op=nl.multiply
            )
            nisa.tensor_tensor(
                dst=dweight_dy[0:q], data1=column["weight"][0:q], data2=row["slope"][0:q], op=nl.multiply
            )
            nisa.tensor_tensor(dst=attended[0:q], data1=weight[0:q], data2=attention[0:q, :, level, :], op=nl.multiply)
            taps.append(
                {
                    "index": index,
                    "weight": weight,
                    "dweight_dx": dweight_dx,
                    "dweight_dy": dweight_dy,
                    "attended": attended,
                }
            )
    return {"taps": taps, "chain_x": chain_x, "chain_y": chain_y}


def _row_pattern(q, channels):
    return [[channels, q], [1, channels]]


def _gather(gathered, rows, index, h, p, q, channels, offset):
    """One value row (C_h channels) per partition, at each partition's own index."""
    nisa.dma_copy(
        dst=gathered[0:q],
        src=rows.ap(
            pattern=_row_pattern(q, channels), offset=offset, vector_offset=index[0:q, h, p : p + 1], indirect_dim=0
        ),
    )


def _scatter_add(grad_rows, index, h, p, q, channels, contribution, b, spec):
    target = grad_rows.ap(
        pattern=_row_pattern(q, channels),
        offset=_batch_offset(b, spec),
        vector_offset=index[0:q, h, p : p + 1],
        indirect_dim=0,
    )
    nisa.dma_compute(dst=target, srcs=[target, contribution[0:q]], reduce_op=nl.add, unique_indices=False)


def _zeros_hbm(rows, channels):
    """A float32 HBM buffer of rows x channels, zeroed through SBUF 128 rows at a time."""
    pmax = nl.tile_size.pmax
    buffer = nl.ndarray((rows * channels,), dtype=nl.float32, buffer=nl.shared_hbm)
    zeros = _zeros_tile((pmax, channels), pmax)
    for r0 in range(0, rows, pmax):
        n = min(pmax, rows - r0)
        nisa.dma_copy(dst=buffer.ap(pattern=[[channels, n], [1, channels]], offset=r0 * channels), src=zeros[0:n])
    return buffer


def _grad_value(grad_rows, value):
    """The float32 accumulation buffer as value's shape and dtype."""
    if value.dtype == nl.float32:
        return grad_rows.reshape(value.shape)
    pmax = nl.tile_size.pmax
    channels = value.shape[3]
    rows = grad_rows.shape[0] // channels
    out = nl.ndarray(value.shape, dtype=value.dtype, buffer=nl.shared_hbm)
    flat = out.reshape((rows * channels,))
    staged = nl.ndarray((pmax, channels), dtype=nl.float32, buffer=nl.sbuf)
    cast = nl.ndarray((pmax, channels), dtype=value.dtype, buffer=nl.sbuf)
    for r0 in range(0, rows, pmax):
        n = min(pmax, rows - r0)
        pattern = [[channels, n], [1, channels]]
        nisa.dma_copy(dst=staged[0:n], src=grad_rows.ap(pattern=pattern, offset=r0 * channels))
        nisa.tensor_copy(dst=cast[0:n], src=staged[0:n])
        nisa.dma_copy(dst=flat.ap(pattern=pattern, offset=r0 * channels), src=cast[0:n])
    return out
