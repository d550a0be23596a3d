"""Examples: a byte-level corpus builder and a small GPT used by the demo, tests and benchmarks."""
