"""miles: RL post-training for LLMs without Ray."""

__version__ = "0.1.0"
