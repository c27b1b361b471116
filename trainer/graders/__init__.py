"""Graders (OpenAI's shapes, trainer/specs/graders.py) scoring a model's samples against dataset items: string
checks, text similarity, user Python in a sandbox, and their arithmetic combination. A reward source for
online RL (trainer/rewards/composite.py) and the graders run endpoint (api/routers/graders.py)."""
