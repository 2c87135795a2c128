"""Compositional checks with an exact answer: GenEval (detector, prompts, rules) and the embedded shapes world."""
