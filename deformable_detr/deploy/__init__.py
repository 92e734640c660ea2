"""Files a trained model runs from outside this package: ONNX (`onnx/`, for onnxruntime, TensorRT and
other runtimes), on a fixed canvas with a pixel mask, as transformers names its inputs and outputs."""
