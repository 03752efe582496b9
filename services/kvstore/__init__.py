"""The kvstore role: the cluster's tiered KV block store (CPU DRAM in shared memory, SSD) that
engines write the blocks they evict back to and fetch prompts' blocks from (docs/kvstore.md)."""
