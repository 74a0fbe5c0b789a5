"""OpenAI-compatible aiohttp server."""
