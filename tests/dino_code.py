"""DINO's own code (github.com/IDEA-Research/DINO), imported from a checkout, on the CPU with the pure-PyTorch
attention core, as the H-Deformable-DETR references were made (tests/hdetr_code.py). Only the reference script
(tests/make_dino_reference.py) uses it; the tests read what it wrote.

What their code needs and this environment lacks gets a small stand-in, each documented below:
- torchvision, MultiScaleDeformableAttention, timm: hdetr_code's stand-ins (torchvision's ResNet and
  IntermediateLayerGetter with their names; their `ms_deform_attn_core_pytorch` for the CUDA kernel; timm's
  DropPath, to_2tuple, trunc_normal_ for their Swin), plus `torchvision.ops.boxes.nms`, which their PostProcess
  calls only with nms_iou_threshold > 0 (their configs have -1): it refuses.
- CUDA: their dn_components.prepare_for_cdn and SetCriterion move tensors with `.cuda()` and `.to('cuda')`.
  `on_the_cpu()` makes `Tensor.cuda` return the tensor itself and maps a 'cuda' device of `Tensor.to` to 'cpu',
  only while it is entered (the model is built and run inside it).
- util.slconfig (yapf, addict): `dino_args` reads their config files the way SLConfig.fromfile does (the
  file's top-level names not starting with '__', its `_base_` files' names first, the file's own over them)
  into main.py's argparse defaults, as their main() merges them."""

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from hdetr_code import _function, _stand_ins

DINO_COMMIT = "faa8520fe9604c23ad65a48bc583550a44c0e3ab"  # the checkout the references were made with


def _refuse_nms(*args, **kwargs):
    raise RuntimeError("their PostProcess runs NMS only with nms_iou_threshold > 0; the references use their -1")


def import_dino(checkout: Path):
    """Their `models` package (models.dino: dino, dn_components, deformable_transformer ...) and `util`, from
    `checkout`, with the stand-ins above and the pure-PyTorch attention core."""
    checkout = Path(checkout).resolve()
    if not (checkout / "models" / "dino" / "dino.py").is_file():
        raise SystemExit(f"{checkout}: not a checkout of IDEA-Research/DINO (no models/dino/dino.py)")
    _stand_ins()
    sys.modules["torchvision.ops.boxes"].nms = _refuse_nms
    sys.path.insert(0, str(checkout))
    import models
    import models.dino.dino
    from models.dino.ops.functions import ms_deform_attn_func
    from models.dino.ops.modules import ms_deform_attn

    class PyTorchCore:
        @staticmethod
        def apply(value, shapes, level_start_index, locations, weights, im2col_step):
            return ms_deform_attn_func.ms_deform_attn_core_pytorch(value, shapes, locations, weights)

    ms_deform_attn.MSDeformAttnFunction = PyTorchCore
    models.checkout = checkout
    return models


def _config_file(path: Path) -> dict:
    """SLConfig._file2dict: the file's top-level names (not '__*'), over those of its `_base_` files."""
    names = {}
    exec(compile(path.read_text(), str(path), "exec"), names)
    names = {k: v for k, v in names.items() if not k.startswith("__")}
    bases = names.pop("_base_", [])
    merged = {}
    for base in [bases] if isinstance(bases, str) else bases:
        merged.update(_config_file(path.parent / base))
    merged.update(names)
    return merged


def dino_args(models, config: str, **changes):
    """Their main.py's argparse defaults (`-c config/DINO/<config>` on the command line) with the config file's
    names set as their main() sets them, then `changes` (each must name an existing argument)."""
    config_path = models.checkout / "config" / "DINO" / config
    parser = _function(models.checkout / "main.py", "get_args_parser", argparse=argparse, DictAction=argparse.Action)
    args = parser().parse_args(["-c", str(config_path)])
    for key, value in _config_file(config_path).items():
        if hasattr(args, key):
            raise ValueError(f"Key {key} can used by args only")  # their main()'s rule
        setattr(args, key, value)
    for key, value in changes.items():
        if not hasattr(args, key):
            raise KeyError(f"DINO's args have no {key}")
        setattr(args, key, value)
    return args


def _cpu(device):
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


@contextmanager
def on_the_cpu():
    """Inside: `Tensor.cuda()` is the tensor itself and `Tensor.to('cuda' ...)` goes to the CPU."""
    cuda, to = torch.Tensor.cuda, torch.Tensor.to

    def to_cpu(self, *args, **kwargs):
        args = tuple(_cpu(a) for a in args)
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return to(self, *args, **kwargs)

    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.to = to_cpu
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.Tensor.to = cuda, to
