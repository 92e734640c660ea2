"""The authors' detection augmentations (datasets/transforms.py) on PIL images and numpy targets.

A target is a dict with `boxes` (n, 4) float32 x0, y0, x1, y1 in pixels and `labels` (n,) int64;
every random choice draws from the `rng` (numpy Generator) passed in, so a sample's augmentation is
reproducible from its seed whatever thread runs it."""

import numpy as np
from PIL import Image

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def _keep(target, keep):
    return {**target, "boxes": target["boxes"][keep], "labels": target["labels"][keep]}


def crop(image, target, top, left, height, width):
    image = image.crop((left, top, left + width, top + height))
    boxes = target["boxes"] - np.array([left, top, left, top], dtype=np.float32)
    boxes = np.minimum(boxes.reshape(-1, 2, 2), np.array([width, height], dtype=np.float32)).clip(min=0)
    target = {**target, "boxes": boxes.reshape(-1, 4)}
    return image, _keep(target, np.all(boxes[:, 1, :] > boxes[:, 0, :], axis=1))  # drop boxes cropped away


def hflip(image, target):
    width = image.width
    boxes = target["boxes"][:, [2, 1, 0, 3]] * np.array([-1, 1, -1, 1], np.float32) + np.array(
        [width, 0, width, 0], np.float32
    )
    return image.transpose(Image.FLIP_LEFT_RIGHT), {**target, "boxes": boxes}


def resized_shape(width, height, size, max_size=None):
    """(height, width) with the shorter side `size` (shrunk so the longer side stays <= max_size). Each side
    is at least one pixel: where the shrunk shorter side rounds to 0 (an image over 2 * max_size times
    longer than wide), it is 1 and the longer side max_size."""
    if max_size is not None:
        short, long = float(min(width, height)), float(max(width, height))
        if long / short * size > max_size:
            size = int(round(max_size * short / long))
            if size < 1:
                return (max_size, 1) if width < height else (1, max_size)
    if (width <= height and width == size) or (height <= width and height == size):
        return height, width
    if width < height:
        return int(size * height / width), size
    return size, int(size * width / height)


def resize(image, target, size, max_size=None):
    height, width = resized_shape(image.width, image.height, size, max_size)
    ratio_w, ratio_h = width / image.width, height / image.height
    image = image.resize((width, height), Image.BILINEAR)
    return image, {**target, "boxes": target["boxes"] * np.array([ratio_w, ratio_h, ratio_w, ratio_h], np.float32)}


class RandomHorizontalFlip:
    def __init__(self, p=0.5):
        self.p = p

    def __call__(self, image, target, rng):
        return hflip(image, target) if rng.random() < self.p else (image, target)


class RandomResize:
    def __init__(self, sizes, max_size=None):
        self.sizes, self.max_size = list(sizes), max_size

    def __call__(self, image, target, rng):
        return resize(image, target, self.sizes[rng.integers(len(self.sizes))], self.max_size)


class RandomSizeCrop:
    """A crop of random width and height in [min_size, min(image side, max_size)]."""

    def __init__(self, min_size, max_size):
        self.min_size, self.max_size = min_size, max_size

    def __call__(self, image, target, rng):
        width = int(rng.integers(min(self.min_size, image.width), min(image.width, self.max_size) + 1))
        height = int(rng.integers(min(self.min_size, image.height), min(image.height, self.max_size) + 1))
        top = int(rng.integers(0, image.height - height + 1))
        left = int(rng.integers(0, image.width - width + 1))
        return crop(image, target, top, left, height, width)


class RandomSelect:
    """`first` with probability p, else `second`."""

    def __init__(self, first, second, p=0.5):
        self.first, self.second, self.p = first, second, p

    def __call__(self, image, target, rng):
        return self.first(image, target, rng) if rng.random() < self.p else self.second(image, target, rng)


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, image, target, rng):
        for transform in self.transforms:
            image, target = transform(image, target, rng)
        return image, target


def normalize(image, target):
    """-> (H, W, 3) float32 ImageNet-normalised, boxes as cx, cy, w, h normalised by the image size."""
    pixels = (np.asarray(image, dtype=np.float32) / 255 - IMAGENET_MEAN) / IMAGENET_STD
    boxes = target["boxes"]
    width, height = image.width, image.height
    cxcywh = np.stack(
        [
            (boxes[:, 0] + boxes[:, 2]) / 2,
            (boxes[:, 1] + boxes[:, 3]) / 2,
            boxes[:, 2] - boxes[:, 0],
            boxes[:, 3] - boxes[:, 1],
        ],
        axis=-1,
    )
    cxcywh = cxcywh / np.array([width, height, width, height], np.float32)
    return pixels, {**target, "boxes": cxcywh.astype(np.float32).reshape(-1, 4)}


def make_transforms(split: str, data_cfg):
    """The authors' train / val pipelines, with the sizes from the config's data section."""
    scales, max_size = data_cfg.scales, data_cfg.max_size
    if split == "train":
        return Compose(
            [
                RandomHorizontalFlip(),
                RandomSelect(
                    RandomResize(scales, max_size=max_size),
                    Compose(
                        [
                            RandomResize(data_cfg.crop_resize),
                            RandomSizeCrop(*data_cfg.crop_size),
                            RandomResize(scales, max_size=max_size),
                        ]
                    ),
                ),
            ]
        )
    return Compose([RandomResize([data_cfg.val_size], max_size=max_size)])
