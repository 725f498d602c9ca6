"""Training with HuggingFace Accelerate."""
