"""OpenAI-compatible routes (placeholder list until the API module lands)."""

openai_routes: list = []
