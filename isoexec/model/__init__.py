"""The unified model family (shared layers, Qwen3-Next and Qwen3.5 members), its caches, Hugging Face
interop and the bitwise gates."""

from isoexec.model.cache import SequenceCache
from isoexec.model.unified import UnifiedModel

__all__ = ["SequenceCache", "UnifiedModel"]
