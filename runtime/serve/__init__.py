"""The OpenAI-compatible server: routes, API types and their mapping to the engine, tool calls, the WebSocket, metrics, the server process."""
