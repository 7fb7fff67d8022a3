"""Stand-in vllm_ascend 0.18.0 for tests (see tests/standins/README.md)."""
