"""Decode worker: continuous-batching decode and token streaming."""
