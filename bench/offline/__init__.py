"""Offline throughput against the peers (`bench offline` on CPU, bench/offline/gpu.sh on CUDA), and
the model FLOPs and matmul peak their efficiency is read against."""
