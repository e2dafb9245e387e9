"""Quantization-error propagation: how error in a quantized KV cache or SSM state grows with position."""
