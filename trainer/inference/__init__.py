"""Serving trained models: the inference process behind the API's OpenAI-compatible chat and completion
routes (``rlrun inference``, started beside the API by ``rlrun serve``). Imports torch; the API does not."""
