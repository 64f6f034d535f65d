"""Structured output: grammars that constrain what a sequence samples (JSON schemas closed as the peers close
them, regexes, Lark), their token bitmasks, over llguidance."""
