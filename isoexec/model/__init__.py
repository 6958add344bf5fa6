"""The unified Qwen3-Next model, its caches, checkpoint I/O and the bitwise gates."""

from isoexec.model.cache import SequenceCache
from isoexec.model.qwen3_next import UnifiedModel

__all__ = ["SequenceCache", "UnifiedModel"]
