"""What poolserve is measured against: offline peers in child processes, the hand-written FastAPI
app, the CPU runtimes (ONNX Runtime, OpenVINO, sentence-transformers) and Infinity's environment."""
