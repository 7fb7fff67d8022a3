"""Stand-in vllm_ascend 0.11.0 for tests (see tests/standins/README.md)."""
