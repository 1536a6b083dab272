"""Tiny random-weight models and a tiny chat tokenizer for fast unit tests (no downloads)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specmemo_core.runtime.model import CausalLM

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and verifies them in one forward pass.",
    "Hello, how are you today? I am fine, thank you!",
    "Memory budgets: weights, heads, KV cache and tree buffers. Ünïcödé ✓ 日本語",
]


def tiny_config(vocab_size: int = 300, layers: int = 2, **kw) -> LlamaConfig:
    base = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    base.update(kw)
    return LlamaConfig(**base)


def tiny_hf_model(seed: int = 0, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(**kw)).eval()


def tiny_model(seed: int = 0, device: str = "cpu", **kw) -> CausalLM:
    hf = tiny_hf_model(seed, **kw)
    return CausalLM.from_state_dict(hf.config, hf.state_dict(), device=device)


def tiny_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE with ChatML markers as special tokens, trained in milliseconds."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.chat_template = CHATML
    return fast


def save_tiny_model_folder(folder, *, layers: int, seed: int = 21, **sizes):
    """A tiny random-weight model saved as a Hugging Face folder (weights and tokenizer),
    as ``Engine.load`` reads one; returns ``folder``."""
    tiny_hf_model(seed=seed, layers=layers, **sizes).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder
