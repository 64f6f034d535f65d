"""POST /tokenize and /detokenize: vLLM's tokenizer endpoints over the served model's tokenizer
(types in protocol.py).

/tokenize takes a prompt or chat messages and answers the ids a completion or chat completion
of the same input would run on (the chat template rendered with the same flags, variables and
tools: api_mapping.chat_prompt), their count and the context they must fit (max_model_len);
with `return_token_strs`, each token's text as logprobs name it (vLLM answers the vocabulary's
raw strings instead, "Ġworld" for " world"). /detokenize turns ids back into text, special
tokens kept. A prompt longer than the context is counted, not refused: that is what a client
asks to know. Rendering and tokenizing run on a thread: a megabyte of text (or a chat with
thousands of tools) never stalls the event loop.

llama-server's endpoints of the same names take `content` (and `with_pieces`) and answer
`tokens` and `content`; a client of those gets a 400 naming `prompt`.
"""

from __future__ import annotations

import asyncio

from nanoinfer.errors import RequestError
from runtime.serve import protocol as api
from runtime.serve.api_mapping import chat_prompt


def request_type(raw) -> type:
    """The /tokenize request a decoded body holds: a chat's (it has `messages`) or a prompt's."""
    return api.TokenizeChatRequest if isinstance(raw, dict) and "messages" in raw else api.TokenizeCompletionRequest


class Tokenization:
    """The tokenizer endpoints of a model: its `tokenizer` (None: the model has none), and the
    longest prompt and output its engine serves."""

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len

    async def tokenize(self, req: api.TokenizeCompletionRequest | api.TokenizeChatRequest) -> api.TokenizeResponse:
        self._check_tokenizer("prompt" if isinstance(req, api.TokenizeCompletionRequest) else "messages")
        return await asyncio.to_thread(self._tokenize, req)

    def _tokenize(self, req: api.TokenizeCompletionRequest | api.TokenizeChatRequest) -> api.TokenizeResponse:
        """The ids the engine would run on (LLMEngine's tokenizing of a request of this kind)."""
        tokenizer = self.tokenizer
        if isinstance(req, api.TokenizeCompletionRequest):
            ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            messages, variables, _ = chat_prompt(req, tokenizer)
            text = tokenizer.apply_chat_template(messages, **variables)
            ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids] if req.return_token_strs else None
        return api.TokenizeResponse(len(ids), self.max_model_len, ids, strs)

    async def detokenize(self, req: api.DetokenizeRequest) -> api.DetokenizeResponse:
        self._check_tokenizer("tokens")
        return await asyncio.to_thread(self._detokenize, req)

    def _detokenize(self, req: api.DetokenizeRequest) -> api.DetokenizeResponse:
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is out of range: expected 0 <= id < {vocab} (the vocabulary's size)",
                               param="tokens")
        return api.DetokenizeResponse(self.tokenizer.decode(req.tokens, skip_special_tokens=False))

    def _check_tokenizer(self, param: str) -> None:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: its prompts are token ids", param=param)
