"""The kvstore role: a tiered KV block store (work in progress)."""
