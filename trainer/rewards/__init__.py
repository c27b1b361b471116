"""Reward sources for online RL: rule-based verifiers, a reward-model scorer, and their weighted sum."""
