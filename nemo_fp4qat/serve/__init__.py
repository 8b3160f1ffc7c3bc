"""Serving an exported checkpoint over HTTP (FastAPI + uvicorn; optional: imported only here)."""

from __future__ import annotations

from .app import CompletionRequest, ServeSettings, create_app
from .backend import PyTorchBackend, TRTLLMBackend, load_backend

__all__ = ["CompletionRequest", "PyTorchBackend", "ServeSettings", "TRTLLMBackend", "create_app", "load_backend"]
