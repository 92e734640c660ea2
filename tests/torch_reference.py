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


def ms_deform_attn_core(
    value, spatial_shapes, sampling_locations, attention_weights, padding_mode="zeros", align_corners=False
):
    batch, _, heads, channels = value.shape
    _, queries, _, levels, points, _ = sampling_locations.shape
    value_list = value.split([h * w for h, w in spatial_shapes], dim=1)
    sampling_grids = 2 * sampling_locations - 1
    sampled = []
    for level, (h, w) in enumerate(spatial_shapes):
        value_l = value_list[level].flatten(2).transpose(1, 2).reshape(batch * heads, channels, h, w)
        grid_l = sampling_grids[:, :, :, level].transpose(1, 2).flatten(0, 1)
        sampled.append(
            F.grid_sample(value_l, grid_l, mode="bilinear", padding_mode=padding_mode, align_corners=align_corners)
        )
    weights = attention_weights.transpose(1, 2).reshape(batch * heads, 1, queries, levels * points)
    output = (torch.stack(sampled, dim=-2).flatten(-2) * weights).sum(-1).view(batch, heads * channels, queries)
    return output.transpose(1, 2).contiguous()


def ms_deform_attn(value, spatial_shapes, locations, weights, cotangent, padding_mode="zeros", align_corners=False):
    """Output and gradients of sum(output * cotangent) w.r.t. value, locations, weights."""
    tensors = [torch.tensor(a, requires_grad=True) for a in (value, locations, weights)]
    out = ms_deform_attn_core(tensors[0], spatial_shapes, tensors[1], tensors[2], padding_mode, align_corners)
    (out * torch.tensor(cotangent)).sum().backward()
    return (out.detach().numpy(), *(t.grad.numpy() for t in tensors))


class MSDeformAttn(torch.nn.Module):
    """The authors' module (models/ops/modules/ms_deform_attn.py) on the PyTorch core."""

    def __init__(self, d_model=256, n_levels=4, n_heads=8, n_points=4):
        super().__init__()
        self.n_levels, self.n_heads, self.n_points, self.d_model = n_levels, n_heads, n_points, d_model
        self.sampling_offsets = torch.nn.Linear(d_model, n_heads * n_levels * n_points * 2)
        self.attention_weights = torch.nn.Linear(d_model, n_heads * n_levels * n_points)
        self.value_proj = torch.nn.Linear(d_model, d_model)
        self.output_proj = torch.nn.Linear(d_model, d_model)
        torch.nn.init.constant_(self.sampling_offsets.weight.data, 0.0)
        thetas = torch.arange(n_heads, dtype=torch.float32) * (2.0 * np.pi / n_heads)
        grid_init = torch.stack([thetas.cos(), thetas.sin()], -1)
        grid_init = (grid_init / grid_init.abs().max(-1, keepdim=True)[0]).view(n_heads, 1, 1, 2)
        grid_init = grid_init.repeat(1, n_levels, n_points, 1)
        for i in range(n_points):
            grid_init[:, :, i, :] *= i + 1
        with torch.no_grad():
            self.sampling_offsets.bias = torch.nn.Parameter(grid_init.view(-1))

    def forward(self, query, reference_points, input_flatten, spatial_shapes, padding_mask=None):
        n, len_q, _ = query.shape
        _, len_in, _ = input_flatten.shape
        value = self.value_proj(input_flatten)
        if padding_mask is not None:
            value = value.masked_fill(padding_mask[..., None], 0.0)
        value = value.view(n, len_in, self.n_heads, self.d_model // self.n_heads)
        offsets = self.sampling_offsets(query).view(n, len_q, self.n_heads, self.n_levels, self.n_points, 2)
        weights = self.attention_weights(query).view(n, len_q, self.n_heads, self.n_levels * self.n_points)
        weights = F.softmax(weights, -1).view(n, len_q, self.n_heads, self.n_levels, self.n_points)
        if reference_points.shape[-1] == 2:
            shapes = torch.as_tensor(spatial_shapes)
            normalizer = torch.stack([shapes[..., 1], shapes[..., 0]], -1)
            locations = reference_points[:, :, None, :, None, :] + offsets / normalizer[None, None, None, :, None, :]
        else:
            locations = (
                reference_points[:, :, None, :, None, :2]
                + offsets / self.n_points * reference_points[:, :, None, :, None, 2:] * 0.5
            )
        out = ms_deform_attn_core(value, spatial_shapes, locations, weights)
        return self.output_proj(out)
