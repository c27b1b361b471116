"""Data preparation for the loops: rows -> tokens -> padded batches, sampling order, validation split.

Torch tensors but no models: ``preference`` (DPO pairs), ``sft`` (prompt/completion), ``reward`` (pairs and
rankings as groups), ``prompts`` (online RL), ``sampling`` (epoch order, hold-out split).
"""
