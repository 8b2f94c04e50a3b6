"""Integrations that attach RL frameworks to a running dynamod stack (verl)."""
