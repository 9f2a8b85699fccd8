"""Model integration: loading (GGUF / Hugging Face, offline), the model-specific tensor functions
of the native loop (``arch``), and blockwise attention with exact merging (``attention``).

Importing this package is cheap: transformers is imported only when a model is loaded.
"""
from tierkv.model.arch import SUPPORTED_ARCHITECTURES, ModelSpec
from tierkv.model.attention import attend, merge, merge_lse
from tierkv.model.loading import LoadedModel, load_model

__all__ = ["SUPPORTED_ARCHITECTURES", "LoadedModel", "ModelSpec", "attend", "load_model", "merge", "merge_lse"]
