"""Swin Transformer backbone as H-Deformable-DETR (HDETR) builds it: their models/swin_transformer.py
(Microsoft's Swin for detection) inside their `TransformerBackbone`, returning feature maps and their
padding masks.

Channels-last throughout: images (B, H, W, 3), features (B, h, w, C). Parameter paths are HDETR's
under `backbone.0.body` (`patch_embed.proj.weight`, `layers.0.blocks.0.attn.qkv.weight`,
`layers.0.downsample.reduction.weight`, `norm1.weight`, ...), so their checkpoints map key for key,
the patch embedding's convolution in MLX's layout (O, kh, kw, I). Their buffers are not parameters
here but computed (`BUFFERS`): a loader drops them.

What HDETR does, kept here because the numbers depend on it:
- the image is padded with zeros on the right and bottom to a multiple of the patch size (4), and
  every block pads its normalised input to a multiple of the window the same way; the padded tokens
  are not masked: they take part in the attention as keys (their key and value are the qkv bias);
- the shifted blocks' mask (-100 between tokens from different regions of the rolled map) is built
  on the padded map, and used even where the map is smaller than a window;
- a stage's output is the map before its patch merging, normalised by that stage's own `norm{i}`, which
  exists for the stages returned only (HDETR's 1..3; DINO's 0..3 in its 5-scale, 1..3 in its 4-scale);
  patch merging pads an odd side by one, so the maps are ceil(H / 8), ceil(H / 16), ceil(H / 32);
- stochastic depth (drop path) with rates linearly spaced from 0 to `drop_path_rate` over all blocks,
  one draw per sample, in training only.
"""

from functools import cache, lru_cache
from typing import NamedTuple

import kernels

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .backbone_base import STAGE_STRIDES, BackboneBase, stages_returned
from .convolution import Conv2d
from .gelu import gelu
from .linear import Linear
from .precision import LayerNorm, to, widened
from .recompute import Dropout, _fresh_key, _next_key, checkpointed


class SwinArchitecture(NamedTuple):
    embed_dim: int
    depths: tuple[int, ...]
    num_heads: tuple[int, ...]
    window_size: int
    pretrain_img_size: int = 224  # HDETR passes it; it only matters with an absolute position embedding (off)


SWIN_ARCHITECTURES = {
    "swin_tiny": SwinArchitecture(96, (2, 2, 6, 2), (3, 6, 12, 24), 7),
    "swin_small": SwinArchitecture(96, (2, 2, 18, 2), (3, 6, 12, 24), 7),
    "swin_base": SwinArchitecture(128, (2, 2, 18, 2), (4, 8, 16, 32), 7),
    "swin_base_window12": SwinArchitecture(128, (2, 2, 18, 2), (4, 8, 16, 32), 12, 384),
    "swin_large": SwinArchitecture(192, (2, 2, 18, 2), (6, 12, 24, 48), 7),
    "swin_large_window12": SwinArchitecture(192, (2, 2, 18, 2), (6, 12, 24, 48), 12, 384),
}
# HDETR's TransformerBackbone builds swin_tiny, swin_small, swin_large and swin_large_window12; the
# two swin_base entries are Microsoft's released Swin-B shapes, built the same way.

OUT_INDICES = (1, 2, 3)  # HDETR's stages returned: strides 8, 16, 32 (DINO's 5-scale adds stage 0: stride 4)
PATCH_SIZE = 4
MLP_RATIO = 4
MASKED = -100.0  # Swin's value between tokens of different regions (not -inf)
# Checkpoint entries that are buffers, not parameters: recomputed here (relative_position_index) or
# rebuilt per input size (attn_mask, in classification checkpoints only). Keys ending so are dropped.
BUFFERS = ("relative_position_index", "attn_mask")


def is_buffer(key: str) -> bool:
    """A checkpoint entry that is a Swin buffer, not a parameter (HDETR's detection checkpoints hold
    `relative_position_index` under backbone.0.body; classification ones `attn_mask` too): drop it."""
    return key.rsplit(".", 1)[-1] in BUFFERS


def architecture(name) -> SwinArchitecture:
    if isinstance(name, SwinArchitecture):
        return name
    if name not in SWIN_ARCHITECTURES:
        raise ValueError(f"unknown Swin backbone {name!r}; expected one of {', '.join(SWIN_ARCHITECTURES)}")
    return SWIN_ARCHITECTURES[name]


def architecture_name(arch: SwinArchitecture) -> str | None:
    """The SWIN_ARCHITECTURES name of `arch`'s shapes (embed dim, blocks, heads, window), or None."""
    named = [name for name, known in SWIN_ARCHITECTURES.items() if known[:4] == arch[:4]]
    return named[0] if named else None


def describe(arch: SwinArchitecture) -> str:
    name = architecture_name(arch)
    shape = (
        f"embed {arch.embed_dim}, depths {'-'.join(map(str, arch.depths))}, "
        f"heads {'-'.join(map(str, arch.num_heads))}, window {arch.window_size}"
    )
    return f"{name} ({shape})" if name else f"a Swin of no known name ({shape})"


def bias_table_rows(window: int) -> int:
    """Rows of a window's relative position bias table: one per offset (dy, dx), each in -(window - 1)..window - 1."""
    return (2 * window - 1) ** 2


def window_of(bias_table) -> int:
    """The window whose bias table this is (`bias_table_rows`' inverse), from the table's shape."""
    return (round(np.sqrt(bias_table.shape[0])) + 1) // 2


@cache
def relative_position_index(window: int) -> mx.array:
    """(window², window²): for each pair of tokens in a window, its row in the bias table (Swin's
    `relative_position_index` buffer): (dy + window - 1) * (2 * window - 1) + dx + window - 1."""
    coords = np.stack(np.meshgrid(np.arange(window), np.arange(window), indexing="ij")).reshape(2, -1)
    relative = coords[:, :, None] - coords[:, None, :] + window - 1
    return mx.array((relative[0] * (2 * window - 1) + relative[1]).astype(np.int32))


@lru_cache(maxsize=16)  # a few image sizes' worth: one is 11 MB at 800 x 1066's first stage
def shift_mask(height: int, width: int, window: int, shift: int) -> mx.array:
    """(windows, window², window²) of 0 and -100 for a shifted block on a (height, width) map padded to
    the window: after the roll, tokens from different regions of the map must not attend to each
    other. HDETR's BasicLayer's `attn_mask`, region for region."""
    regions = np.zeros((height, width), np.float32)
    bands = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    for i, rows in enumerate(bands):
        for j, cols in enumerate(bands):
            regions[rows, cols] = 3 * i + j
    windows = partition(mx.array(regions)[None, :, :, None], window)[..., 0]
    different = windows[:, None, :] != windows[:, :, None]
    return mx.where(different, MASKED, 0.0)


def partition(x: mx.array, window: int) -> mx.array:
    """(B, H, W, C), H and W multiples of `window` -> (B * windows, window², C), windows in row order."""
    b, h, w, c = x.shape
    x = x.reshape(b, h // window, window, w // window, window, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, window * window, c)


def merge(windows: mx.array, window: int, height: int, width: int) -> mx.array:
    """`partition`'s inverse: (B * windows, window², C) -> (B, height, width, C)."""
    c = windows.shape[-1]
    x = windows.reshape(-1, height // window, width // window, window, window, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, height, width, c)


def pad_to(x: mx.array, multiple: int) -> mx.array:
    """(B, H, W, C) padded with zeros at the bottom and right to multiples of `multiple`."""
    bottom, right = -x.shape[1] % multiple, -x.shape[2] % multiple
    return mx.pad(x, [(0, 0), (0, bottom), (0, right), (0, 0)]) if bottom or right else x


def _linear(in_features: int, out_features: int, bias: bool = True) -> Linear:
    """HDETR's initialisation: weights normal, std 0.02 (timm's trunc_normal_ cuts at +-2, 100 std:
    never), biases 0."""
    layer = Linear(in_features, out_features, bias=bias)
    layer.weight = 0.02 * mx.random.normal((out_features, in_features))
    if bias:
        layer.bias = mx.zeros((out_features,))
    return layer


class DropPath(Dropout):
    """Stochastic depth (timm's DropPath): in training, a residual branch is dropped for a whole sample
    with probability p, kept and scaled by 1 / (1 - p) otherwise. A `recompute.Dropout`, so its draws
    come from the key of the checkpointed unit it runs in: the recomputation drops the same samples."""

    def __call__(self, x):
        if not self.training or self.p == 0:
            return x
        key = _next_key()
        keep = mx.random.bernoulli(
            1 - self.p, (x.shape[0],) + (1,) * (x.ndim - 1), key=_fresh_key() if key is None else key
        )
        return x * (keep.astype(x.dtype) / (1 - self.p))


class PatchEmbed(nn.Module):
    """4 x 4 patches, stride 4, to `embed_dim` channels, then a LayerNorm (HDETR's patch_norm=True)."""

    def __init__(self, embed_dim: int):
        super().__init__()
        self.proj = Conv2d(3, embed_dim, PATCH_SIZE, PATCH_SIZE, 0)
        self.norm = LayerNorm(embed_dim)

    def __call__(self, images):
        return self.norm(self.proj(pad_to(images, PATCH_SIZE)))


class WindowAttention(nn.Module):
    """Multi-head self-attention inside each window, with a learned bias per head and relative
    position (a (2 * window - 1)² table)."""

    def __init__(self, dim: int, window: int, num_heads: int):
        super().__init__()
        self.window = window
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.relative_position_bias_table = 0.02 * mx.random.normal((bias_table_rows(window), num_heads))
        self.qkv = _linear(dim, 3 * dim)
        self.proj = _linear(dim, dim)

    def position_bias(self) -> mx.array:
        """(heads, window², window²), float32."""
        tokens = self.window * self.window
        table = widened(self.relative_position_bias_table)
        return table[relative_position_index(self.window).reshape(-1)].reshape(tokens, tokens, -1).transpose(2, 0, 1)

    def __call__(self, x, mask=None):
        """x (B * windows, window², C); mask (windows, window², window²) or None."""
        windows, tokens, dim = x.shape
        # (3, B * windows, heads, tokens, head_dim), float32: MLX's bfloat16 products are slow. q, k and v
        # as views, sliced and squeezed: qkv[0] made a strided copy of each (a first-stage block's attention
        # at 800 x 1066 took 247 ms with those copies, 121 ms without)
        qkv = widened(self.qkv(x)).reshape(windows, tokens, 3, self.num_heads, -1).transpose(2, 0, 3, 1, 4)
        q, k, v = (qkv[i : i + 1].squeeze(0) for i in range(3))
        scores = (q * self.scale) @ k.transpose(0, 1, 3, 2) + self.position_bias()
        if mask is not None:  # the same mask for every image's windows
            scores = scores.reshape(-1, mask.shape[0], self.num_heads, tokens, tokens) + mask[:, None]
            scores = scores.reshape(windows, self.num_heads, tokens, tokens)
        out = (kernels.softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(windows, tokens, dim)
        return self.proj(to(out, x.dtype))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = _linear(dim, hidden)
        self.fc2 = _linear(hidden, dim)

    def __call__(self, x):
        return self.fc2(gelu(self.fc1(x)))  # torch's nn.GELU(): the exact (erf) one, fast (gelu.py)


class SwinTransformerBlock(nn.Module):
    """Windowed attention (shifted by half a window in odd blocks) and an MLP, each pre-normalised
    and residual, each branch behind the block's drop path."""

    def __init__(self, dim: int, num_heads: int, window: int, shift: int, drop_path: float):
        super().__init__()
        self.window, self.shift = window, shift
        self.norm1 = LayerNorm(dim)
        self.attn = WindowAttention(dim, window, num_heads)
        self.drop_path = DropPath(drop_path)
        self.norm2 = LayerNorm(dim)
        self.mlp = Mlp(dim, MLP_RATIO * dim)

    def __call__(self, x, mask):
        """x (B, H, W, C); mask: `shift_mask` of the padded map, used by shifted blocks."""
        _, height, width, _ = x.shape
        window, shift = self.window, self.shift
        shifted = pad_to(self.norm1(x), window)  # padded after the norm: zeros
        padded_height, padded_width = shifted.shape[1:3]
        if shift:
            shifted = mx.roll(shifted, (-shift, -shift), axis=(1, 2))
        attended = self.attn(partition(shifted, window), mask if shift else None)
        attended = merge(attended, window, padded_height, padded_width)
        if shift:
            attended = mx.roll(attended, (shift, shift), axis=(1, 2))
        x = x + self.drop_path(attended[:, :height, :width])
        return x + self.drop_path(self.mlp(self.norm2(x)))


class PatchMerging(nn.Module):
    """Each 2 x 2 group of tokens concatenated (an odd side padded by one), normalised, projected to
    twice the channels: stride x2."""

    def __init__(self, dim: int):
        super().__init__()
        self.reduction = _linear(4 * dim, 2 * dim, bias=False)
        self.norm = LayerNorm(4 * dim)

    def __call__(self, x):
        x = pad_to(x, 2)
        b, h, w, c = x.shape
        # Swin's order of the four: (0, 0), (1, 0), (0, 1), (1, 1) as (row, column) offsets
        x = x.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 4, 2, 5).reshape(b, h // 2, w // 2, 4 * c)
        return self.reduction(self.norm(x))


class BasicLayer(nn.Module):
    """A stage: `depth` blocks, even ones in windows, odd ones in shifted windows; then patch merging
    (but the last stage)."""

    def __init__(self, dim, depth, num_heads, window, drop_paths, downsample: bool):
        super().__init__()
        self.window = window
        self.blocks = [
            SwinTransformerBlock(dim, num_heads, window, 0 if i % 2 == 0 else window // 2, drop_paths[i])
            for i in range(depth)
        ]
        if downsample:
            self.downsample = PatchMerging(dim)

    def __call__(self, x, activation_checkpointing: bool = False):
        """-> (the stage's output, the next stage's input)."""
        window = self.window
        mask = shift_mask(-(-x.shape[1] // window) * window, -(-x.shape[2] // window) * window, window, window // 2)
        for block in self.blocks:
            x = checkpointed([block], lambda x, block=block: block(x, mask), x, enabled=activation_checkpointing)
        return x, (self.downsample(x) if "downsample" in self else x)


class SwinTransformer(nn.Module):
    """HDETR's SwinTransformer (patch_norm, no absolute position embedding, qkv bias, mlp_ratio 4, no
    dropout; DINO's is the same code): returns the normalised outputs of `stages` (their out_indices), stage i
    (B, H / 2^(i + 2), W / 2^(i + 2), 2^i * embed_dim), sides rounded up: by default stages 1..3, (B, H/8, W/8,
    2 * embed_dim) to (B, H/32, W/32, 8 * embed_dim)."""

    def __init__(self, name, drop_path_rate: float = 0.2, stages: tuple[int, ...] = OUT_INDICES):
        super().__init__()
        arch = architecture(name)
        self.architecture = arch
        self.patch_embed = PatchEmbed(arch.embed_dim)
        total = sum(arch.depths)
        rates = np.linspace(0, drop_path_rate, total, dtype=np.float32).tolist()  # torch.linspace's, float32
        self.layers = []
        for i, (depth, heads) in enumerate(zip(arch.depths, arch.num_heads, strict=True)):
            first = sum(arch.depths[:i])
            downsample = i < len(arch.depths) - 1
            dim = arch.embed_dim * 2**i
            self.layers.append(
                BasicLayer(dim, depth, heads, arch.window_size, rates[first : first + depth], downsample)
            )
        self.num_features = [arch.embed_dim * 2**i for i in range(len(arch.depths))]
        self.stages = tuple(stages)
        for i in self.stages:
            setattr(self, f"norm{i}", LayerNorm(self.num_features[i]))
        self.num_channels = [self.num_features[i] for i in self.stages]
        self.activation_checkpointing = False  # recompute each block in the backward (recompute.py), as HDETR

    def __call__(self, images):
        x = self.patch_embed(images)
        outputs = []
        for i, layer in enumerate(self.layers):
            out, x = layer(x, self.activation_checkpointing)
            if i in self.stages:
                outputs.append(getattr(self, f"norm{i}")(out))
        return outputs


class SwinBackbone(BackboneBase):
    """Swin body; returns [(features (B, h, w, C), mask (B, h, w))] of its last `maps`: stage 3's (1), stages
    1..3's at strides 8/16/32 (3), or stages 0..3's at 4/8/16/32 (4: DINO's 5-scale, with norm0). `name`: a key
    of SWIN_ARCHITECTURES (or a SwinArchitecture). HDETR's body returns all three maps even when it says
    stride 32 only; here the last only (its norm1 and norm2 kept: they are in HDETR's checkpoints)."""

    def __init__(self, name, maps: int = 3, drop_path_rate: float = 0.2):
        stages = stages_returned(maps)
        strides = tuple(STAGE_STRIDES[i] for i in stages)
        super().__init__(SwinTransformer(name, drop_path_rate, stages), maps, strides)

    def set_trainable(self, train: bool, freeze_stem_and_layer1: bool = True):
        """All of Swin trains (`train`), or none. `freeze_stem_and_layer1` is ignored: it is the
        Deformable DETR authors' choice for a ResNet; HDETR trains every Swin parameter, the patch
        embedding included, whenever the backbone trains (TransformerBackbone freezes nothing, its
        frozen_stages is -1), as does DINO (its configs' backbone_freeze_keywords None), and so does this, to
        train as they did."""
        self.body.unfreeze()
        if not train:
            self.body.freeze()
