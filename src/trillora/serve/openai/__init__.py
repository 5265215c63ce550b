"""The OpenAI-compatible face: its routes and request checks, translated into the service's calls."""
