"""A GGUF file written from a Hugging Face Llama folder with the ``gguf`` package's writer, the way
llama.cpp's converter lays it out (tensor names ``blk.N.attn_q.weight``..., Q and K rows permuted for
its rotary layout, a GPT-2 style BPE vocabulary), so import tests read a file no rlrun code wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rows from HF's half-split rotary order to
    interleaved pairs (transformers' GGUF loader undoes it)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_llama_gguf(model: Any, tokenizer: Any, path: Path, chat_template: str = CHATML) -> Path:
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(len(tokenizer))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    tokens = [t for t, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])]
    writer.add_token_list(tokens)
    special = set(tokenizer.all_special_ids)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    )
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(chat_template)
    for key, value in model.state_dict().items():
        array = value.float().numpy()
        if key == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif key == "model.norm.weight":
            name = "output_norm.weight"
        elif key == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            name = "output.weight"
        else:
            parts = key.split(".")  # model.layers.<i>.<module>.<sub>.weight
            module = ".".join(parts[3:-1])
            name = f"blk.{parts[2]}.{_LAYER_TENSORS[module]}.weight"
            if module == "self_attn.q_proj":
                array = llama_cpp_permute(array, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                array = llama_cpp_permute(array, cfg.num_key_value_heads)
        writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
