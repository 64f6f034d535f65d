"""The CPU backend: the native C kernels for packed (GGUF) weights, built at first use, the packed layers
over them, and RoPE with the KV write in a few torch ops."""
