"""Model integration: loading (GGUF / Hugging Face, offline), the model-specific tensor functions
of the native loop (``arch``), the dense engine and the sparse engine, and ``tierkv run``.

Importing this package is cheap: transformers is imported only when a model is loaded.
"""
from tierkv.model.arch import SUPPORTED_ARCHITECTURES, ModelSpec
from tierkv.model.loading import LoadedModel, load_model

__all__ = ["SUPPORTED_ARCHITECTURES", "LoadedModel", "ModelSpec", "load_model"]
