"""Rollout engines: generate completions for online RL behind one interface (``base.RolloutEngine``).

``hf_engine.HFEngine`` (default, any device) wraps ``model.generate``; ``vllm_engine.VllmEngine`` (GPU,
optional extra) imports vLLM only when constructed. ``factory.make_engine`` picks one by name. Nothing is
imported here, so ``import trainer.rollout.base`` stays torch-free.
"""
