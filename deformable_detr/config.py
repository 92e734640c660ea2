"""Configuration: dataclass defaults (the authors' `main.py` defaults), overridden by a YAML file,
overridden by `section.key=value` strings. An unknown key is an error that names it and the nearest
known key.

A config file is a path, or the name of a config shipped in the package (`r50`, `shapes`, ...:
`deformable_detr/configs/`, which a checkout's `configs/` links to), so `--config shapes` works in
any folder. Relative paths inside a config (`data.path`) are relative to the
current directory, where the command runs (as the quick start's `data/shapes`), not to the file.

A run's config.yaml is the config it started with and, where a `train.py --resume` changed it,
`changes:`, each a `{from_global_step: N, section.key: [old, new], ...}`: a file is read
with its changes applied, the config in effect last."""

import dataclasses
import difflib
import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .errors import UsageError

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"  # the shipped configs (a checkout's configs/ links here)
EXIF_FRAMES = ("auto", "displayed", "stored")  # data.exif_orientation's choices (data/images.py reads by them)
BIG = 1 << 20  # a count's range's bound above: none in practice


@dataclass
class ModelConfig:
    # resnet18 | resnet34 | resnet50 | resnet101 | swin_tiny | swin_small | swin_base | swin_large (window 7) |
    # swin_base_window12 | swin_large_window12 (window 12, ImageNet-22k at 384)
    backbone: str = "resnet50"
    # a ResNet's first stage's channels (torchvision: 64); smaller for a small model
    backbone_width: int = field(default=64, metadata={"range": (1, BIG)})
    dilation: bool = False  # DC5: dilate a ResNet's last stage instead of striding it
    # Swin backbones: stochastic depth's rate in the last block (H-Deformable-DETR's 0.2)
    drop_path_rate: float = field(default=0.2, metadata={"range": (0.0, 1.0)})
    # 1: the backbone's last map; more: its maps (3), then extra levels made from the last. Which settings
    # go together (this with the backbone, hidden_dim with nheads, ...): models/combinations.py
    num_feature_levels: int = field(default=4, metadata={"range": (1, BIG)})
    # how many of the backbone's maps are levels, its coarsest: 1, 3 (strides 8, 16, 32) or 4 (and stride 4: DINO's
    # 5-scale); auto: 1 with one level, else 3
    backbone_maps: int = field(default="auto", metadata={"auto": True})
    hidden_dim: int = field(default=256, metadata={"range": (1, BIG)})
    nheads: int = field(default=8, metadata={"range": (1, BIG)})
    enc_layers: int = 6
    dec_layers: int = field(default=6, metadata={"range": (1, BIG)})
    dim_feedforward: int = field(default=1024, metadata={"range": (1, BIG)})
    dropout: float = field(default=0.1, metadata={"range": (0.0, 1.0)})
    enc_n_points: int = 4
    dec_n_points: int = 4
    num_queries: int = field(default=300, metadata={"range": (1, BIG)})
    # COCO category ids run 1..90; index 0 and the gaps are never targets. `auto`: the largest
    # category id of the train annotations + 1 (train.py), or the weights' class count (eval, predict).
    num_classes: int = field(default=91, metadata={"auto": True})
    with_box_refine: bool = False
    two_stage: bool = False
    aux_loss: bool = True
    # H-Deformable-DETR's recipe ("DETRs with Hybrid Matching", github.com/HDETR/H-Deformable-DETR); off in the
    # authors' configs. mixed_selection, two-stage only: the decoder's positions from the encoder's top proposals,
    # its content queries learned (query_embed).
    mixed_selection: bool = False
    # box refinement: each layer's boxes predicted from the refined boxes of the layer before, the gradient
    # reaching through them (the same outputs at inference; the weights do not show it)
    look_forward_twice: bool = False
    # the hybrid branch: this many more queries, trained one-to-many (loss.k_one2many) and kept apart from the
    # num_queries one-to-one queries in the decoder's self-attention; in training only (0: none)
    num_queries_one2many: int = field(default=0, metadata={"range": (0, BIG)})
    # deformable_detr | dino: DINO (github.com/IDEA-Research/DINO) is Deformable DETR two-stage with box refinement,
    # mixed selection and look forward twice, plus: each decoder layer's query positions made from its reference
    # boxes (ref_point_head), a norm on the decoder's outputs, one class head and one box head shared by the decoder
    # layers (the encoder's own apart), proposals chosen by their best class, the position encoding without the
    # half-pixel offset, and contrastive denoising in training (dn_*). Its configs: configs/dino_*.yaml
    architecture: str = field(default="deformable_detr", metadata={"choices": ("deformable_detr", "dino")})
    # the sine position encoding's temperature (the authors' 10000; DINO's 20) and half-pixel offset (the authors'
    # 0.5; DINO's 0)
    position_temperature: float = field(default=10000.0, metadata={"range": (1.0, 1e9)})
    position_offset: float = field(default=0.5, metadata={"range": (0.0, 1.0)})
    # DINO's decoder's class and box heads: shared (one of each for every layer: DINO's configs) | per_layer
    # (detrex's DINO); auto: shared for DINO, and the authors' rule for theirs (per layer with box refinement)
    decoder_heads: str = field(default="auto", metadata={"choices": ("auto", "shared", "per_layer")})
    # DINO's contrastive denoising: every step at most 2 x dn_number queries (groups of a noised positive and negative
    # copy of every target; as many groups as fit), a fixed count whatever the targets; 0: none. The labels are
    # changed at random with probability dn_label_noise_ratio / 2, the boxes moved by up to dn_box_noise_scale of
    # their size (the negatives beyond it); dn_labelbook_size labels are embedded (auto: num_classes)
    dn_number: int = field(default=0, metadata={"range": (0, BIG)})
    dn_label_noise_ratio: float = field(default=0.5, metadata={"range": (0.0, 1.0)})
    dn_box_noise_scale: float = field(default=0.4, metadata={"range": (0.0, BIG)})
    dn_labelbook_size: int = field(default="auto", metadata={"auto": True})


@dataclass
class MatcherConfig:
    set_cost_class: float = 2.0
    set_cost_bbox: float = 5.0
    set_cost_giou: float = 2.0


@dataclass
class LossConfig:
    cls_loss_coef: float = 2.0
    bbox_loss_coef: float = 5.0
    giou_loss_coef: float = 2.0
    focal_alpha: float = 0.25
    # the hybrid branch (model.num_queries_one2many): its queries matched to the targets repeated k times,
    # its losses (suffix _one2many) weighted by lambda
    k_one2many: int = field(default=6, metadata={"range": (1, 1 << 10)})
    lambda_one2many: float = 1.0


@dataclass
class OptimizerConfig:
    lr: float = 2e-4
    lr_backbone: float = 2e-5
    freeze_stem_and_layer1: bool = True  # the authors' choice for a pretrained ResNet (Swin has neither: all trains)
    lr_linear_proj_mult: float = 0.1  # for the parameters named below
    lr_linear_proj_names: list = field(default_factory=lambda: ["reference_points", "sampling_offsets"])
    weight_decay: float = 1e-4
    clip_max_norm: float = 0.1


@dataclass
class ScheduleConfig:
    epochs: int = 50
    lr_drop: int = 40  # learning rates x 0.1 from this epoch on
    batch_size: int = 32  # images per optimizer step over all processes (the authors': 2 per GPU on 16 GPUs)
    # Images per forward and backward in each process; the gradients of a process's share of the batch
    # accumulate over its micro-batches. `auto`: the largest that divides the share and fits
    # train.memory_limit_gb (the memory plan, training/memory_plan.py: the whole share where it fits).
    micro_batch_size: int = field(default="auto", metadata={"auto": True})


@dataclass
class DataConfig:
    # coco | shapes | yolo | voc | createml, or a registered name (deformable_detr/data/__init__.py)
    dataset: str = "coco"
    # Where the dataset is: COCO's root folder, YOLO's data.yaml (or its folder), VOC's folder holding
    # Annotations/, Create ML's folder holding train/ and valid/ (data.coco_path, its old name, is read as it)
    path: str = "data/coco"
    num_workers: int = 2  # mlx-data threads decoding and augmenting
    prefetch: int = 4  # batches prepared ahead
    scales: list = field(default_factory=lambda: list(range(480, 801, 32)))  # train: shorter side, at random
    max_size: int = 1333  # longer side at most
    crop_resize: list = field(default_factory=lambda: [400, 500, 600])  # before the random crop
    crop_size: list = field(default_factory=lambda: [384, 600])  # random crop side range
    val_size: int = 800
    skip_bad_images: bool = False  # False: a missing or unreadable image stops with its path
    # the frame of EXIF-tagged photos (deformable_detr/data/images.py): auto (YOLO: as displayed; COCO,
    # VOC: the frame whose size the annotations record, as stored where both are equal) | displayed | stored
    exif_orientation: str = field(default="auto", metadata={"choices": EXIF_FRAMES})


@dataclass
class TrainConfig:
    max_steps: int = 0  # stop after this many steps in all (0: run the whole schedule)
    check_sampling_offsets: bool = True  # first step: stop if a sampling_offsets gradient is zero or not finite
    checkpoint_every: int = 0  # also checkpoint every N steps (0: at the end of each epoch only)
    log_every: int = 1  # steps between JSON-lines log records
    eval_every: int = 1  # epochs between evaluations (0: never)
    # recompute the backbone (a ResNet's stages 2-4, every Swin block) and every transformer layer in the backward;
    # auto: only when the memory check finds that a step without it would not fit train.memory_limit_gb (train.py)
    activation_checkpointing: bool = field(default=False, metadata={"auto": True})
    memory_limit_gb: float = 0.0  # refuse to start when a step would need more (0: 80% of the machine's memory)
    # bfloat16: convolutions, linears and the attention's values computed in bfloat16, the weights,
    # AdamW, losses, matching, softmax and normalisations in float32; refused where bfloat16 products
    # are not fast (a CPU without AMX or AVX512-BF16: about 20x slower), unless precision_even_if_slow
    precision: str = field(default="float32", metadata={"choices": ("float32", "bfloat16")})
    precision_even_if_slow: bool = False
    ema_decay: float = field(default=0.0, metadata={"range": (0.0, 1.0)})  # an EMA of the weights (0: none)
    ema_warmup: int = 2000  # steps over which the EMA's decay rises to ema_decay
    # stop after this many evaluations without a higher val AP (0: never)
    early_stop_patience: int = field(default=0, metadata={"range": (0, 1 << 31)})
    # TensorBoard event files under <run>/tensorboard/: the step records' scalars, each evaluation's
    # AP and pictures (needs tensorboard, in the tensorboard extra)
    tensorboard: bool = False
    # MLflow (the mlflow extra): false | true (a store in <run>/mlflow, or $MLFLOW_TRACKING_URI) | a
    # tracking URI: the config, the step scalars, each evaluation's AP, the checkpoint and pictures
    mlflow: bool | str = field(default=False, metadata={"text": True})
    # Weights & Biases (the wandb extra): false | offline (<run>/wandb; `wandb sync` uploads it), as mlflow
    wandb: bool | str = field(default=False, metadata={"text": True, "choices": (False, "offline")})


@dataclass
class EvaluationConfig:
    # COCO AP's implementation: faster_coco_eval (the same numbers, several times faster) where it is
    # installed (auto), else pycocotools
    backend: str = field(default="auto", metadata={"choices": ("auto", "pycocotools", "faster_coco_eval")})
    # detections kept per image, the best (query, class) pairs: the authors' 100; H-Deformable-DETR's Swin-L
    # 900-query model reports 57.6 AP with 300, DINO's configs keep 300 (COCO's AP counts up to 100 per image and
    # class); predict, slicing and the server keep as many
    top_k: int = field(default=100, metadata={"range": (1, 1 << 20)})


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    matcher: MatcherConfig = field(default_factory=MatcherConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    seed: int = 42


# How a change of each key on `train.py --resume` (training/resume_check.py) bears on the run the
# checkpoint continues. TRAINS: what is trained or in what order (refused without --allow-change KEY).
# RUNS: how it runs, not what (noted): workers, cadences, memory, where it stops (max_steps, the
# patience; epochs, the schedule's length, is the recipe's: TRAINS), the micro-batch (the same
# gradients accumulated to the same step, summed in another order: the last bits). DATA: where the
# data set is, RUNS where both values name one place, else TRAINS. tests/test_resume_config.py checks
# that every key is here.
TRAINS, RUNS, DATA = "trains", "runs", "data"
CHANGES_KEY = "changes"  # config.yaml's history of a resumed run's changes (load_config)
_MODEL_KEYS = ("backbone", "backbone_width", "dilation", "drop_path_rate", "num_feature_levels", "hidden_dim")
_MODEL_KEYS += ("nheads", "enc_layers")
_MODEL_KEYS += ("dec_layers", "dim_feedforward", "dropout", "enc_n_points", "dec_n_points", "num_queries")
_MODEL_KEYS += ("num_classes", "with_box_refine", "two_stage", "aux_loss", "mixed_selection", "look_forward_twice")
_MODEL_KEYS += ("num_queries_one2many", "architecture", "position_temperature", "dn_number", "dn_label_noise_ratio")
_MODEL_KEYS += ("dn_box_noise_scale", "dn_labelbook_size", "backbone_maps", "position_offset", "decoder_heads")
_OPTIMIZER_KEYS = ("lr", "lr_backbone", "freeze_stem_and_layer1", "lr_linear_proj_mult", "lr_linear_proj_names")
_OPTIMIZER_KEYS += ("weight_decay", "clip_max_norm")
RESUME_EFFECTS = {
    **{f"model.{key}": TRAINS for key in _MODEL_KEYS},
    **{f"matcher.{key}": TRAINS for key in ("set_cost_class", "set_cost_bbox", "set_cost_giou")},
    **{f"loss.{key}": TRAINS for key in ("cls_loss_coef", "bbox_loss_coef", "giou_loss_coef", "focal_alpha")},
    **{f"loss.{key}": TRAINS for key in ("k_one2many", "lambda_one2many")},
    **{f"optimizer.{key}": TRAINS for key in _OPTIMIZER_KEYS},
    **{f"schedule.{key}": TRAINS for key in ("epochs", "lr_drop", "batch_size")},
    "schedule.micro_batch_size": RUNS,
    "data.dataset": TRAINS,
    "data.path": DATA,
    "data.num_workers": RUNS,
    "data.prefetch": RUNS,
    **{f"data.{key}": TRAINS for key in ("scales", "max_size", "crop_resize", "crop_size", "exif_orientation")},
    "data.val_size": TRAINS,  # the evaluations, hence the best checkpoint and early stopping
    "data.skip_bad_images": RUNS,  # what an unreadable image's stop says to resume with
    **{f"train.{key}": RUNS for key in ("max_steps", "check_sampling_offsets", "checkpoint_every", "log_every")},
    **{f"train.{key}": RUNS for key in ("eval_every", "activation_checkpointing", "memory_limit_gb")},
    **{f"train.{key}": RUNS for key in ("early_stop_patience", "tensorboard", "mlflow", "wandb")},
    "train.precision_even_if_slow": RUNS,  # a permission: the run computes what train.precision says
    **{f"train.{key}": TRAINS for key in ("precision", "ema_decay", "ema_warmup")},
    "evaluation.backend": RUNS,  # the same numbers
    "evaluation.top_k": TRAINS,  # the evaluations' AP, hence the best checkpoint and early stopping
    "seed": TRAINS,
}


def load_config(path=None, overrides=(), base: dict | None = None, base_source: str = "") -> Config:
    """Defaults, then `base` (a config as a dict, e.g. a checkpoint's, named `base_source`), then the
    YAML file at `path` (if any; its `changes:` applied in order), then `section.key=value` overrides.
    Anything wrong in them is a UsageError naming the file (and line) or override, the key and the value."""
    cfg = Config()
    if base is not None:
        _merge(cfg, base, base_source, "")
    if path is not None:
        data = _read_yaml(Path(path))
        changes = data.pop(CHANGES_KEY, [])
        _merge(cfg, data, str(path), "")
        for change in changes if isinstance(changes, list) else [changes]:
            step = change.get("from_global_step") if isinstance(change, dict) else None
            pairs = {k: v for k, v in change.items() if k != "from_global_step"} if step is not None else {}
            if not pairs or not all(isinstance(pair, list) and len(pair) == 2 for pair in pairs.values()):
                expected = "{from_global_step: N, section.key: [old, new], ...}"
                raise UsageError(f"{path}: {CHANGES_KEY}: expected a list of {expected}, got {change!r}")
            for key, (_, value) in pairs.items():
                _merge(cfg, nested_key(key, value), f"{path}: {CHANGES_KEY} from global step {step}", "")
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key:
            raise UsageError(f"override {override!r}: expected section.key=value")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as error:
            raise UsageError(f"override {override!r}: {value!r} is not a YAML value ({_problem(error)})") from None
        _merge(cfg, nested_key(key, parsed), "override", "")
    return cfg


def nested_key(key: str, value, values: dict | None = None) -> dict:
    """`values` (default: a new dict) with `section.key` set to `value`: {section: {key: value}}."""
    values = {} if values is None else values
    *sections, name = key.split(".")
    inner = values
    for part in sections:
        inner = inner.setdefault(part, {})
    inner[name] = value
    return values


def shipped_configs() -> list[str]:
    """The names of the configs shipped in the package."""
    return sorted(path.stem for path in CONFIGS_DIR.glob("*.yaml"))


def config_file(name_or_path) -> Path:
    """The YAML file a `--config` names: a file there, else the shipped config of that name (`r50`,
    `shapes.yaml`); else a UsageError listing them."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = CONFIGS_DIR / (path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml")
    if path.parent == Path(".") and shipped.is_file():
        return shipped
    raise UsageError(f"config file not found: {path} (a path, or a shipped config: {', '.join(shipped_configs())})")


def read_yaml(path: Path):
    """The YAML value in `path`; not YAML: a ValueError naming the file, line and column. The one YAML
    reader: config files (as UsageErrors) and YOLO's data.yaml (`data/files.py`)."""
    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text, so not YAML (byte {error.start})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{path}{where}: not valid YAML ({_problem(error)})") from None


def _read_yaml(path: Path) -> dict:
    path = config_file(path)
    try:
        data = read_yaml(path) or {}
    except ValueError as error:
        raise UsageError(str(error)) from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
    return data


def _problem(error: yaml.YAMLError) -> str:
    return getattr(error, "problem", None) or str(error).splitlines()[0]


# Keys renamed: a config, override or checkpoint that writes the old name is read as the new one, with a note.
RENAMED = {"data.coco_path": "data.path"}


@functools.cache
def _note_renamed(source: str, old: str, new: str):
    print(f"{source}: {old} is read as {new} (its name now)", file=sys.stderr)


def _renamed(data: dict, source: str, prefix: str) -> dict:
    """`data` with the old names of RENAMED under `prefix` read as their new ones; the new one's value wins where
    both are set (and the new one is not empty)."""
    data = dict(data)
    for old, new in RENAMED.items():
        section, _, old_name = old.rpartition(".")
        new_name = new.rpartition(".")[2]
        if prefix == f"{section}." and old_name in data:
            value = data.pop(old_name)
            if data.get(new_name) in (None, ""):
                data[new_name] = value
            _note_renamed(source, old, new)
    return data


def _merge(target, data: dict, source: str, prefix: str):
    data = _renamed(data, source, prefix)
    names = {f.name: f for f in dataclasses.fields(target)}
    unknown = sorted(set(data) - set(names))
    if unknown:
        more = f" (also unknown: {', '.join(prefix + k for k in unknown[1:])})" if unknown[1:] else ""
        raise UsageError(f"{source}: {unknown_key(unknown[0], names, prefix)}{more}")
    for key, value in data.items():
        current = getattr(target, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise UsageError(f"{source}: {prefix}{key} must be a mapping of its keys, got {value!r}")
            _merge(current, value, source, f"{prefix}{key}.")
        else:
            default = names[key].default
            expected = current if default is dataclasses.MISSING else default
            if expected == "auto":  # `auto` is no type: the annotated one's
                expected = names[key].type()
            where, allowed = f"{source}: {prefix}{key}", names[key].metadata
            coerced = _coerce(value, expected, where, allowed.get("auto"), allowed.get("text"))
            setattr(target, key, _allowed(coerced, allowed, where))


def unknown_key(key: str, names, prefix: str) -> str:
    """`section.key: unknown key; did you mean section.other?`, or the section's keys when none is near."""
    near = difflib.get_close_matches(str(key), list(names), n=1)
    if near:
        return f"{prefix}{key}: unknown key; did you mean {prefix}{near[0]}?"
    return f"{prefix}{key}: unknown key; expected one of {', '.join(prefix + k for k in names)}"


def _coerce(value, current, where, auto=False, text=False):
    """Keep each key's type: an int where a float is expected is fine, `auto` where the field allows
    it, text where it does (`text`: a bool or text, as train.mlflow's URI), anything else is an error."""
    if auto and value == "auto":
        return value
    if text and isinstance(value, str):
        return value
    kind = type(current).__name__ + (" or auto" if auto else "") + (" or text" if text else "")
    if isinstance(current, bool) or isinstance(value, bool):
        if not (isinstance(current, bool) and isinstance(value, bool)):
            raise UsageError(f"{where} must be {kind}, got {value!r}")
        return value
    if isinstance(current, float) and isinstance(value, int):
        return float(value)
    if isinstance(current, float) and isinstance(value, str):  # YAML reads 1e-3 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if not isinstance(value, type(current)):
        raise UsageError(f"{where} must be {kind}, got {value!r}")
    return value


def _allowed(value, allowed: dict, where: str):
    """A field's `choices` or half-open `range` [low, high), from its metadata."""
    if "choices" in allowed and value not in allowed["choices"]:
        listed = ", ".join(str(c).lower() if isinstance(c, bool) else c for c in allowed["choices"])  # YAML's false
        raise UsageError(f"{where} must be one of {listed}, got {value!r}")
    if "range" in allowed and not allowed["range"][0] <= value < allowed["range"][1]:
        low, high = allowed["range"]
        raise UsageError(f"{where} must be at least {low} and below {high}, got {value!r}")
    return value


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def flat_config(cfg: Config) -> dict:
    """{section.key: value} of every key (`RESUME_EFFECTS`' keys)."""

    def flat(values: dict, prefix: str):
        for key, value in values.items():
            yield from flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [(prefix + key, value)]

    return dict(flat(config_to_dict(cfg), ""))


def set_later_keys() -> set:
    """The keys whose `auto` is a value set later (the memory plan's micro-batch and activation
    checkpointing, the data's class count): {section.key} of each field whose metadata says "auto"
    (not those where `auto` is itself a setting, as data.exif_orientation's)."""
    return {
        f"{section.name}.{key.name}"
        for section in dataclasses.fields(Config)
        if section.default_factory is not dataclasses.MISSING  # a section (seed is a plain key)
        for key in dataclasses.fields(section.default_factory)
        if key.metadata.get("auto")
    }


def model_overrides(options: dict) -> list[str]:
    """ModelConfig fields (e.g. what converted weights record) as `load_config` overrides."""
    return [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items()]
