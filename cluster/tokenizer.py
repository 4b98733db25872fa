"""Tokenizer and chat template through transformers (``AutoTokenizer``, ``gguf_file=`` for GGUF)."""

from __future__ import annotations

from shardserve.workers.model_source import ModelFiles


def load_tokenizer(files: ModelFiles):
    """The model's tokenizer: from the GGUF metadata, or the folder's tokenizer files."""
    from transformers import AutoTokenizer

    if files.is_gguf:
        return AutoTokenizer.from_pretrained(str(files.folder), gguf_file=files.path.name)
    return AutoTokenizer.from_pretrained(str(files.path))


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of a raw prompt, with the special tokens the tokenizer adds by itself (e.g. BOS)."""
    return list(tokenizer(prompt)["input_ids"])


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a chat rendered by the model's template.

    The template's text already holds every special token it wants (BOS included when the
    template writes one), so it is encoded with ``add_special_tokens=False``: BOS never appears
    twice.

    Raises:
        ValueError: the tokenizer has no chat template, or ``messages`` is malformed.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use a raw prompt")
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def eos_token_ids(tokenizer, hf_config) -> set[int]:
    """Every id that ends generation: the config's ``eos_token_id`` (int or list) and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids
