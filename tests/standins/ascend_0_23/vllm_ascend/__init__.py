"""Stand-in vllm_ascend 0.23.0 for tests (see tests/standins/README.md)."""
