"""The HTTP / websocket service around the engine (Litestar)."""
