"""GCache storage node (docs/gcache.md)."""
