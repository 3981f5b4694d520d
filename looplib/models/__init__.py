"""Small reference models, pure PyTorch."""
from .bert import BertClassifier
from .gpt import GPT, Block

__all__ = ["GPT", "Block", "BertClassifier"]
