"""The port every reward implements (Scorer, Reward), the combiner (MultiReward), the registry of names, the timeout,
shared helpers."""
