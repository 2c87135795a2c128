"""flowrl: reinforcement learning for flow-matching text-to-image models."""
__version__ = "0.1.0"
