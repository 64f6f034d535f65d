"""Text <-> token ids: the tokenizer over each checkpoint format's vocabulary, and the chat template."""
