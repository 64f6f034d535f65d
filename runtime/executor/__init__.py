"""Everything on a device: the model runner (KV pools, persistent batch, graphs, forward and sampling), the draft model, tensor-parallel ranks."""
