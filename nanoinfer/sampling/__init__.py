"""Sampling: SamplingParams, the vectorized sampler, a row's draw (its reference), penalties and logit bias,
speculative decoding's rejection sampling, n-gram prompt lookup, and a checkpoint's recommended defaults."""
