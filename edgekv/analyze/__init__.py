"""Quantization-error propagation: how error in a quantized KV cache or SSM state grows with position."""

WEIGHT_BITS = (4, 8)  # the integer precisions of `edgekv export --weights` (here, torch-free, for analyze's --help)
