"""Export to ONNX: the detector as one graph of standard ops on a fixed canvas (`export --to onnx`,
`Detector.export("onnx", ...)`).

`builder.py` writes graphs; `backbone.py`, `encoding.py`, `attention.py`, `transformer.py`,
`proposals.py`, `dino.py` (DINO's queries and decoder) and `detector.py` mirror the MLX model's
parts; `export.py` takes a model, writes the file and checks it with onnxruntime. Needs the `onnx`
extra."""
