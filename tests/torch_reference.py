"""PyTorch references: `F.grid_sample`, and the authors' `ms_deform_attn_core_pytorch` (from
fundamentalvision/Deformable-DETR, models/ops/functions/ms_deform_attn_func.py), generalised to
the padding modes and align_corners of `kernels.ms_deform_attn`."""

import numpy as np
import torch
import torch.nn.functional as F


def grid_sample(inp_nhwc, grid, cotangent, mode, padding_mode, align_corners):
    """Output (NHWC) and gradients of sum(output * cotangent) w.r.t. input (NHWC) and grid."""
    inp = torch.tensor(np.ascontiguousarray(inp_nhwc.transpose(0, 3, 1, 2)), requires_grad=True)
    grd = torch.tensor(grid, requires_grad=True)
    out = F.grid_sample(inp, grd, mode=mode, padding_mode=padding_mode, align_corners=align_corners)
    out = out.permute(0, 2, 3, 1)
    (out * torch.tensor(cotangent)).sum().backward()
    return out.detach().numpy(), inp.grad.permute(0, 2, 3, 1).numpy(), grd.grad.numpy()


def ms_deform_attn_core(value, spatial_shapes, sampling_locations, attention_weights,
                        padding_mode="zeros", align_corners=False):
    batch, _, heads, channels = value.shape
    _, queries, _, levels, points, _ = sampling_locations.shape
    value_list = value.split([h * w for h, w in spatial_shapes], dim=1)
    sampling_grids = 2 * sampling_locations - 1
    sampled = []
    for level, (h, w) in enumerate(spatial_shapes):
        value_l = value_list[level].flatten(2).transpose(1, 2).reshape(batch * heads, channels, h, w)
        grid_l = sampling_grids[:, :, :, level].transpose(1, 2).flatten(0, 1)
        sampled.append(F.grid_sample(value_l, grid_l, mode="bilinear", padding_mode=padding_mode,
                                     align_corners=align_corners))
    weights = attention_weights.transpose(1, 2).reshape(batch * heads, 1, queries, levels * points)
    output = (torch.stack(sampled, dim=-2).flatten(-2) * weights).sum(-1).view(batch, heads * channels, queries)
    return output.transpose(1, 2).contiguous()


def ms_deform_attn(value, spatial_shapes, locations, weights, cotangent, padding_mode="zeros", align_corners=False):
    """Output and gradients of sum(output * cotangent) w.r.t. value, locations, weights."""
    tensors = [torch.tensor(a, requires_grad=True) for a in (value, locations, weights)]
    out = ms_deform_attn_core(tensors[0], spatial_shapes, tensors[1], tensors[2], padding_mode, align_corners)
    (out * torch.tensor(cotangent)).sum().backward()
    return (out.detach().numpy(), *(t.grad.numpy() for t in tensors))
