"""The CUDA backend: Triton kernels (linear layers, fused layer parts, norms, RoPE and the KV write, the draw,
grammar masks, argmax), CUDA graphs, programmatic dependent launch, and the shipped tuning tables."""
