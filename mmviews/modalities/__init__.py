"""Modality adapters: one view -> one point on the shared unit sphere."""
