"""The streamed GGUF load of the real default model equals transformers' import of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.runtime.model import CausalLM
from specmemo_core.storage.sources import ensure_default_model, load_model

pytestmark = pytest.mark.integration


def _greedy(config, state_dict, prompt: list[int], tokens: int) -> list[int]:
    model = CausalLM.from_state_dict(config, state_dict)
    decoder = Decoder(model, model.new_cache(len(prompt) + tokens + 1))
    return [t for step in decoder.generate(prompt, GenerationConfig(max_new_tokens=tokens)) for t in step.token_ids]


def test_streamed_default_model_equals_transformers_import(shared_data_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_default_model()
    ours = load_model("default")
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                              local_files_only=True)
    expected = {k: v.detach() for k, v in hf.state_dict().items()}
    assert ours.state_dict.keys() == expected.keys()
    assert [k for k, v in expected.items() if not torch.equal(ours.state_dict[k], v)] == []
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                  "tie_word_embeddings", "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours.config, field) == getattr(hf.config, field), field
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    chat = [{"role": "user", "content": "Name three prime numbers."}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == prompt
    ids = tokenizer(prompt).input_ids
    assert ours.tokenizer(prompt).input_ids == ids
    assert _greedy(ours.config, ours.state_dict, ids, 24) == _greedy(hf.config, expected, ids, 24)
