"""Stand-in vllm_ascend 0.13.0 for tests (see tests/standins/README.md)."""
