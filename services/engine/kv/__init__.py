"""The paged, tiered KV cache: block pool and tables, hot/warm tiers, KIVI INT4 and its error estimate."""
