"""FastAPI server: OpenAI speech routes, voices, WebSocket, metrics, health. `create_app(csm, config)`."""
from csmserve.server.app import create_app

__all__ = ["create_app"]
