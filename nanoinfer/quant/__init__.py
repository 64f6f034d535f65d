"""Quantized weights: each form (int8, fp8, int4, GGUF's packed groups and K-quants), its matmul and its
dequantized reference."""
