"""The persistent prefix cache on disk, under the block pool (--kv-cache-disk)."""
