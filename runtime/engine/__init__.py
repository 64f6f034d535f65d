"""The engine on one thread: requests, sequences, KV blocks, the plan, the step, and the outputs it makes."""
