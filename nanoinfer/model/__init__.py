"""The model as data and pure functions: its config (and the checks of each value), the decoder's forward, the eager
reference layers, a step's Batch, the paged KV pool, and the other families' forwards (nanochat)."""
