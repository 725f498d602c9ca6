"""mmviews: multimodal, multi-view representation learning."""

__version__ = "0.1.0"
