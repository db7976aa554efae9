"""kvscope's backend: the model, the engine, the event stream and the server."""
