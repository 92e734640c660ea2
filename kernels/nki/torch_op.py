"""A drop-in for the authors' `MSDeformAttnFunction` (models/ops/functions/ms_deform_attn_func.py)
under torch-neuronx: the same arguments, with the NKI forward and backward kernels of
`ms_deform_attn.py` in place of their CUDA extension.

    from kernels.nki.torch_op import MSDeformAttnFunction
    output = MSDeformAttnFunction.apply(value, value_spatial_shapes, value_level_start_index,
                                        sampling_locations, attention_weights, im2col_step)

value (N, Len_in, n_heads, C) and sampling_locations (N, Len_q, n_heads, n_levels, n_points, 2)
are the library's BLNC and BQHLP2 layouts. The level shapes and starts become compile-time
constants of the kernels (read once with `.tolist()`); `im2col_step` is accepted and unused (the
kernels tile queries by 128 instead).
"""

import torch

from .ms_deform_attn import ms_deformable_attention, ms_deformable_attention_bwd


class MSDeformAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights, im2col_step
    ):
        ctx.shapes = tuple((int(h), int(w)) for h, w in value_spatial_shapes.tolist())
        ctx.starts = tuple(int(s) for s in value_level_start_index.tolist())
        ctx.save_for_backward(value, sampling_locations, attention_weights)
        return ms_deformable_attention(value, ctx.shapes, ctx.starts, sampling_locations, attention_weights)

    @staticmethod
    def backward(ctx, grad_output):
        value, sampling_locations, attention_weights = ctx.saved_tensors
        grad_value, grad_locations, grad_weights = ms_deformable_attention_bwd(
            grad_output.contiguous(), value, ctx.shapes, ctx.starts, sampling_locations, attention_weights
        )
        return grad_value, None, None, grad_locations.to(sampling_locations.dtype), grad_weights, None
