"""The model: the zoo and its candidate cuts, cost accounting, bottlenecks, users' models, ONNX."""
