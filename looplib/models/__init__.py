"""Small reference models, pure PyTorch."""
from .gpt import GPT, Block

__all__ = ["GPT", "Block"]
