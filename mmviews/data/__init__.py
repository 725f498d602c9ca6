"""Datasets, view specs, augmentations and the view-set collator."""
