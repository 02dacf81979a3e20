"""Model parallelism for one engine: tensor-parallel attention, expert-parallel MoE (docs/parallel.md)."""
