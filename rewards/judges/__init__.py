"""Vision-language judges: one reward, a local transformers backend and a served (OpenAI-compatible) one."""
