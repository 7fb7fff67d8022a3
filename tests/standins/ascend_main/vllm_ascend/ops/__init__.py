"""Stand-in vllm_ascend.ops (main)."""
