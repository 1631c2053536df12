"""A tiny Llama for the end-to-end tests, made on the spot: 2 layers, hidden size 128, head
size 64, a byte-level BPE tokenizer trained here on a generated corpus, and random weights
drawn from a fixed seed (saved as safetensors, so that every engine loads the same model; vLLM's
``dummy`` weights are too small for the KV to change what the model says). Nothing is
downloaded.

    python tiny_llama.py DIR
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

LAYERS, HIDDEN, HEADS, KV_HEADS, INTERMEDIATE = 2, 128, 2, 2, 256
WORDS = (
    "the a of to and in is it that was for on are with as his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like "
    "so these her long make thing see him two has look more day could go come did number sound "
    "no most people my over know water than call first who may down side been now find any new "
    "work part take get place made live where after back little only round man year came show "
    "every good me give our under name very through just form sentence great think say help low "
    "line differ turn cause much mean before move right boy old too same tell does set three"
).split()


def corpus(lines: int = 4000, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(lines):
        n = int(rng.integers(4, 16))
        yield " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n)) + "."


def make(path: str, seed: int = 0) -> str:
    """Writes the model into ``path`` (made if missing); returns ``path``."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    vocab = tok.get_vocab_size()
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                   "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 2048,
                   "add_bos_token": False}, f)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HIDDEN // HEADS,
        "num_hidden_layers": LAYERS, "vocab_size": vocab, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.3):
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1]) * 4).astype(np.float32)

    head = HIDDEN // HEADS
    tensors = {"model.embed_tokens.weight": w(vocab, HIDDEN, scale=1.0 / 4 * np.sqrt(HIDDEN)),
               "model.norm.weight": np.ones(HIDDEN, np.float32), "lm_head.weight": w(vocab, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(HEADS * head, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * head, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * head, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * head),
            p + "mlp.gate_proj.weight": w(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": w(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, INTERMEDIATE),
            p + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
            p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
        }
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


if __name__ == "__main__":
    print(make(sys.argv[1]))
