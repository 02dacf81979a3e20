"""Encoder tier (#16): images / videos -> vision-tower embeddings, cached by content hash (docs/multimodal.md)."""
