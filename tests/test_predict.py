"""predict: where the model looks (sampling points and weights in the original images' pixels,
against Hugging Face's PyTorch model seen through forward hooks), many images, videos, bad input."""

import json
from pathlib import Path

from deformable_detr import build_model, load_config
from deformable_detr.data.loader import collate
from deformable_detr.data.transforms import normalize, resize
from deformable_detr.inference.attention_points import recording
from deformable_detr.predict import main as predict_main

import mlx.core as mx
import numpy as np
import pytest
import yaml
from mlx.utils import tree_flatten
from PIL import Image, ImageDraw

TINY = Path(__file__).parent / "fixtures" / "tiny.yaml"

SIZES = {"wide": (150, 100), "tall": (90, 140)}  # width x height, before the resize to val_size 64
DATA = {"val_size": 64, "max_size": 96}


def picture(width, height, seed):
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))
    pen = ImageDraw.Draw(image)
    for _ in range(3):
        x, y = rng.integers(0, width - 30), rng.integers(0, height - 30)
        pen.rectangle([x, y, x + 25, y + 20], fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    return image


@pytest.fixture(scope="module", params=["base", "refine+two_stage"])
def huggingface(request, tmp_path_factory):
    """A random Hugging Face Deformable DETR, its weights converted, a config for predict, two images."""
    pytest.importorskip("torch", reason="the PyTorch reference (dev extra)")
    pytest.importorskip("transformers", reason="the Hugging Face reference (dev extra)")
    from deformable_detr.convert import main as convert_main

    from hf_reference import huggingface_model

    tmp = tmp_path_factory.mktemp(request.param)
    hf = huggingface_model(request.param)  # offsets and weights far from their initialisation: the points spread
    hf.save_pretrained(tmp / "hf")
    convert_main([str(tmp / "hf"), str(tmp / "weights.safetensors")])
    from deformable_detr.weights.conversion import convert

    _, options, _ = convert(tmp / "hf")
    (tmp / "config.yaml").write_text(yaml.safe_dump({"model": {**options, "dropout": 0.0}, "data": DATA}))
    images = {}
    for seed, (name, (width, height)) in enumerate(SIZES.items()):
        images[name] = tmp / f"{name}.png"
        picture(width, height, seed).save(images[name])
    return hf, tmp, images


def reference_view(hf, image_paths):
    """Hugging Face's model on the batch predict builds: per attention module (decoder layers, then
    the encoder's), the sampling locations and weights its core receives and the reference points
    and valid ratios it computed, through forward hooks."""
    import torch

    samples = []
    for path in image_paths:
        empty = {"boxes": np.zeros((0, 4), np.float32), "labels": np.zeros(0, np.int64)}
        samples.append(normalize(*resize(Image.open(path).convert("RGB"), empty, DATA["val_size"], DATA["max_size"])))
    pixels, mask, _ = collate(samples)
    seen, hooks, ratios = {}, [], []
    original_ratio = hf.model.get_valid_ratio

    def valid_ratio(m, dtype=torch.float32):
        ratios.append(original_ratio(m, dtype))
        return ratios[-1]

    hf.model.get_valid_ratio = valid_ratio
    parts = [("decoder", hf.model.decoder.layers, "encoder_attn"), ("encoder", hf.model.encoder.layers, "self_attn")]
    for part, layers, attribute in parts:
        for index, layer in enumerate(layers):
            module = getattr(layer, attribute)
            record = seen.setdefault((part, index), {})
            hooks.append(
                module.register_forward_pre_hook(
                    lambda m, args, kwargs, r=record: r.update(reference=kwargs["reference_points"].numpy()),
                    with_kwargs=True,
                )
            )
            hooks.append(
                module.attn.register_forward_hook(
                    lambda m, args, out, r=record: r.update(
                        locations=args[4].numpy(), weights=args[5].numpy(), shapes=args[2]
                    )
                )
            )
    with torch.no_grad():
        hf(pixel_values=torch.tensor(pixels).permute(0, 3, 1, 2), pixel_mask=torch.tensor(~mask).long())
    for hook in hooks:
        hook.remove()
    del hf.model.get_valid_ratio
    return seen, torch.stack(ratios, 1).numpy()  # (B, levels, 2) x, y


def test_sampling_points_are_the_reference_models_in_original_pixels(huggingface, tmp_path):
    hf, tmp, images = huggingface
    argv = [
        "--config",
        str(tmp / "config.yaml"),
        "--checkpoint",
        str(tmp / "weights.safetensors"),
        "--precision",
        "float32",
    ]
    argv += ["--output-dir", str(tmp_path), "--threshold", "0", "--batch-size", "2"]
    views = [reference_view(hf, [path]) for path in images.values()]  # each alone: predict pads no image
    for layer in (0, 1):
        predict_main([*argv, "--attention", "--attention-layer", str(layer), *map(str, images.values())])
        for (name, (width, height)), (seen, ratios) in zip(SIZES.items(), views, strict=True):
            reference, b = seen[("decoder", layer)], 0
            records = json.loads((tmp_path / f"{name}.json").read_text())
            assert all("sampling_points" in r for r in records)  # threshold 0: every detection
            size = np.array([width, height])
            for record in records[:40]:
                q = record["query"]
                expected = reference["locations"][b, q] / ratios[b][None, :, None, :] * size
                np.testing.assert_allclose(record["sampling_points"], expected, atol=0.02, rtol=1e-4)
                np.testing.assert_allclose(record["sampling_weights"], reference["weights"][b, q], atol=2e-5)
                point = reference["reference"][b, q, 0]
                np.testing.assert_allclose(record["reference_point"], point[:2] / ratios[b, 0] * size, atol=0.01)
                if point.shape[-1] == 4:
                    centre, extent = point[:2] / ratios[b, 0] * size, point[2:] / ratios[b, 0] * size
                    np.testing.assert_allclose(
                        record["reference_box"], [*centre - extent / 2, *centre + extent / 2], atol=0.01
                    )
            assert (tmp_path / f"{name}.attention.png").is_file()
    points = np.array([r["sampling_points"] for r in records])
    assert points.std(axis=(0, 1, 2, 3)).min() > 1  # the points spread over the image, not a fixed pattern
    assert all(np.all(ratios == 1) for _, ratios in views)  # no image padded (the batching rule)


def test_encoder_pixel_is_the_reference_models_query_there(huggingface, tmp_path):
    hf, tmp, images = huggingface
    x, y = 70.0, 45.0
    argv = [
        "--config",
        str(tmp / "config.yaml"),
        "--checkpoint",
        str(tmp / "weights.safetensors"),
        "--precision",
        "float32",
    ]
    argv += ["--output-dir", str(tmp_path), "--batch-size", "2", "--encoder-pixel", f"{x:g},{y:g}"]
    predict_main([*argv, *map(str, images.values())])
    views = [reference_view(hf, [path]) for path in images.values()]  # each alone: predict pads no image
    for (name, (width, height)), (seen, ratios) in zip(SIZES.items(), views, strict=True):
        reference, b = seen[("encoder", 1)], 0  # the last encoder layer
        starts = np.cumsum([0] + [h * w for h, w in reference["shapes"]])
        view = json.loads((tmp_path / f"{name}.encoder.json").read_text())
        assert view["pixel"] == [x, y] and view["layer"] == 1 and len(view["queries"]) == 4
        size = np.array([width, height])
        for query in view["queries"]:
            level = query["level"]
            # the reference model's query there: of that level's, the one whose reference point (its
            # cell's centre) is nearest the pixel
            centres = reference["reference"][b, starts[level] : starts[level + 1], level] / ratios[b, level] * size
            nearest = starts[level] + np.argmin(np.abs(centres - [x, y]).max(-1))
            np.testing.assert_allclose(query["reference_point"], centres[nearest - starts[level]], atol=0.01)
            expected = reference["locations"][b, nearest] / ratios[b][None, :, None, :] * size
            np.testing.assert_allclose(query["sampling_points"], expected, atol=0.02, rtol=1e-4)
            np.testing.assert_allclose(query["sampling_weights"], reference["weights"][b, nearest], atol=2e-5)
        assert (tmp_path / f"{name}.encoder.png").is_file()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny config's model with its initial weights, saved as converted weights are."""
    tmp = tmp_path_factory.mktemp("tiny")
    mx.random.seed(3)
    model = build_model(load_config(TINY))
    mx.save_safetensors(str(tmp / "weights.safetensors"), dict(tree_flatten(model.parameters())))
    return ["--config", str(TINY), "--checkpoint", str(tmp / "weights.safetensors")], tmp


def test_recording_changes_nothing_and_ends_with_its_block(tiny):
    argv, _ = tiny
    mx.random.seed(3)
    model = build_model(load_config(TINY))
    model.eval()
    images, mask = mx.random.normal((2, 64, 80, 3)), mx.zeros((2, 64, 80), dtype=mx.bool_)
    plain = model(images, mask)
    with recording(model, decoder_layer=0, encoder_layer=-1) as recorders:
        recorded = model(images, mask)
    for key in ("pred_logits", "pred_boxes"):
        np.testing.assert_array_equal(np.array(plain[key]), np.array(recorded[key]))
    assert [len(r.calls) for r in recorders.values()] == [1, 1]
    assert recorders["decoder"].calls[0].locations.shape == (2, 10, 4, 4, 2, 2)  # B, Q, heads, levels, points
    attention = [m for _, m in model.named_modules() if hasattr(m, "sampling_offsets")]
    assert len(attention) == 3 and all(m.recorder is None for m in attention)
    model(images, mask)
    assert len(recorders["decoder"].calls) == 1  # nothing recorded once the block has ended
    with pytest.raises(ValueError, match="decoder layer 2 is out of range: the model has 2"):
        with recording(model, decoder_layer=2):
            pass


def test_folders_globs_and_batches(tiny, tmp_path, capsys):
    argv, tmp = tiny
    folder = tmp_path / "photos"
    folder.mkdir()
    for i, (width, height) in enumerate([(80, 64), (80, 64), (70, 90)]):
        picture(width, height, i).save(folder / f"p{i}.png")
    picture(64, 64, 9).save(tmp_path / "extra.jpg")
    (folder / "notes.txt").write_text("not an image, and not named like one")
    alone = tmp_path / "alone"
    predict_main(
        [*argv, "--output-dir", str(alone), "--threshold", "0", *(str(p) for p in sorted(folder.glob("*.png")))]
    )
    out = tmp_path / "out"
    predict_main(
        [*argv, "--output-dir", str(out), "--threshold", "0", "--batch-size", "2", str(folder), str(tmp_path / "*.jpg")]
    )
    said = capsys.readouterr().out
    assert "4 image(s) in" in said and "images/s (batches of 2)" in said
    assert sorted(p.name for p in out.glob("*.json")) == ["extra.json", "p0.json", "p1.json", "p2.json"]
    for i in range(2):  # batched together (the same size: no padding), the detections of each alone
        batched, single = (json.loads((d / f"p{i}.json").read_text()) for d in (out, alone))
        assert [(r["query"], r["label"]) for r in batched[:5]] == [(r["query"], r["label"]) for r in single[:5]]
        np.testing.assert_allclose([r["score"] for r in batched], [r["score"] for r in single], atol=1e-5)
        np.testing.assert_allclose([r["box"] for r in batched[:5]], [r["box"] for r in single[:5]], atol=0.01)
    picture(64, 64, 5).save(tmp_path / "p0.png")
    with pytest.raises(SystemExit) as stopped:
        predict_main([*argv, "--output-dir", str(out), str(folder / "p0.png"), str(tmp_path / "p0.png")])
    assert stopped.value.code == 2  # a usage error
    said = capsys.readouterr().err
    assert f"{folder / 'p0.png'} and {tmp_path / 'p0.png'} would write the same outputs" in said


def test_an_unreadable_image_among_many(tiny, tmp_path, capsys):
    argv, _ = tiny
    for i in range(3):
        picture(64, 64, i).save(tmp_path / f"{i}.png")
    (tmp_path / "1.png").write_bytes(b"\x89PNG truncated")
    argv = [*argv, "--output-dir", str(tmp_path / "out"), str(tmp_path)]
    with pytest.raises(SystemExit, match=r"1\.png: cannot read image: .*--skip-unreadable"):
        predict_main(argv)
    assert not (tmp_path / "out").exists()  # found before any work
    predict_main([*argv, "--skip-unreadable"])
    assert f"skipped: {tmp_path / '1.png'}: cannot read image" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "out").glob("*.json")) == ["0.json", "2.json"]


def test_video_round_trip(tiny, tmp_path):
    av = pytest.importorskip("av", reason="videos need PyAV (the video extra, in dev)")
    argv, _ = tiny
    frames = [picture(97, 75, seed) for seed in range(7)]  # odd sides: the annotated video is cropped to even
    with av.open(str(tmp_path / "clip.mp4"), "w") as sink:
        stream = sink.add_stream("libx264", rate=5)
        stream.width, stream.height, stream.pix_fmt = 96, 74, "yuv420p"
        for image in frames:
            sink.mux(stream.encode(av.VideoFrame.from_image(image.crop((0, 0, 96, 74)))))
        sink.mux(stream.encode())
    out = tmp_path / "out"
    predict_main([*argv, "--output-dir", str(out), "--threshold", "0.0", str(tmp_path / "clip.mp4")])
    record = json.loads((out / "clip.json").read_text())
    assert len(record["frames"]) == 7 and record["fps"] == 5
    with av.open(str(out / "clip.mp4")) as annotated:
        assert sum(1 for _ in annotated.decode(video=0)) == 7
    with av.open(str(tmp_path / "clip.mp4")) as source:
        decoded = [frame.to_image() for frame in source.decode(video=0)]
    decoded[4].save(tmp_path / "frame4.png")  # what predict gets from frame 4, as an image file
    predict_main([*argv, "--output-dir", str(tmp_path / "image"), "--threshold", "0.0", str(tmp_path / "frame4.png")])
    as_image = json.loads((tmp_path / "image" / "frame4.json").read_text())
    assert as_image == record["frames"][4]["detections"]


def test_videos_need_the_extra(tiny, tmp_path, monkeypatch):
    argv, _ = tiny
    (tmp_path / "clip.mp4").write_bytes(b"")
    monkeypatch.setitem(__import__("sys").modules, "av", None)  # as if PyAV were not installed
    with pytest.raises(SystemExit, match=r'reading a video needs av, in the "video" extra: pip install'):
        predict_main([*argv, str(tmp_path / "clip.mp4")])
