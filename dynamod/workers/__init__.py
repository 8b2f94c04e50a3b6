"""CPU rollout worker and the tiny local model it serves."""
