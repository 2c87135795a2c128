"""Rewards over HTTP: the `remote` client, its transport, and the reward server (`python -m
flowrl_rewards.serving.serve`)."""
