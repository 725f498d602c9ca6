"""Taking a trained encoder out of its run folder: a Hugging Face Hub-ready folder
(:mod:`mmviews.export.hf`) and ONNX graphs (:mod:`mmviews.export.onnx`) that
:mod:`mmviews.export.onnx_runtime` runs with onnxruntime and numpy alone."""
