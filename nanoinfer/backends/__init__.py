"""What runs a model on each device: `choose.py` picks the forward and the kernels for a device; `cuda/` and
`cpu/` hold each backend's kernels, each beside the reference it is tested against."""
