"""Precisions on CPU: fidelity and speed of each --dtype and --quantization (`bench precision`), and
poolserve's precisions against the CPU runtimes per CPU class (`bench cpu-peers`)."""
