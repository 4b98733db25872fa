"""Tokenizer and chat template through transformers (``AutoTokenizer``, ``gguf_file=`` for GGUF)."""

from __future__ import annotations

import json
from pathlib import Path

from shardserve.workers.model_source import ModelFiles


# Chat templates for checkpoints that ship their prompt format as code instead (model_type -> file).
_BUILTIN_TEMPLATES = {"deepseek_v32": "deepseek_v32.jinja"}


def load_tokenizer(files: ModelFiles):
    """The model's tokenizer: from the GGUF metadata, or the folder's tokenizer files. A checkpoint
    without a chat template whose format we know (DeepSeek-V3.2 ships ``encoding_dsv32.py``) gets
    ours (``cluster/frontend/templates/``). A GGUF file's metadata is parsed at most once per
    process for the config and the tokenizer together (:func:`workers.gguf_file.transformers_parses_once`)."""
    from transformers import AutoTokenizer

    if files.is_gguf:
        from shardserve.workers.gguf_file import transformers_parses_once

        with transformers_parses_once():
            return AutoTokenizer.from_pretrained(str(files.folder), gguf_file=files.path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(files.path))
    if not getattr(tokenizer, "chat_template", None):
        template = builtin_template(files.path / "config.json")
        if template is not None:
            tokenizer.chat_template = template
    return tokenizer


def builtin_template(config_path: Path) -> str | None:
    """Our chat template for the checkpoint whose ``config.json`` is ``config_path`` (None: none)."""
    try:
        model_type = json.loads(config_path.read_text()).get("model_type")
    except (OSError, ValueError):
        return None
    name = _BUILTIN_TEMPLATES.get(model_type)
    if name is None:
        return None
    return (Path(__file__).resolve().parent / "frontend" / "templates" / name).read_text(encoding="utf-8")


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of a raw prompt, with the special tokens the tokenizer adds by itself (e.g. BOS)."""
    return list(tokenizer(prompt)["input_ids"])


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                template_kwargs: dict | None = None) -> str:
    """A chat as the model's template writes it (``apply_chat_template``).

    Args:
        messages: ``{"role", "content", ...}`` dicts (assistant ``tool_calls``, tool results and
            earlier thinking as :func:`cluster.frontend.chat_request.chat_messages` shapes them).
        tools: OpenAI function tools, passed as the template's ``tools`` (None: no tools).
        template_kwargs: extra template variables (``thinking``, ``enable_thinking``, ...).

    Raises:
        ValueError: the tokenizer has no chat template, ``messages`` is malformed, or the template
            refused the chat (its own error, e.g. roles out of order).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use a raw prompt")
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             tools=tools or None, **(template_kwargs or {}))
    except (TemplateError, TypeError) as exc:   # raise_exception() in a template, or a template bug on this input
        raise ValueError(f"the chat template cannot render these messages: {exc}") from None


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a chat rendered by the model's template (see :func:`render_chat`).

    The template's text already holds every special token it wants (BOS included when the
    template writes one), so it is encoded with ``add_special_tokens=False``: BOS never appears
    twice.

    Raises:
        ValueError: as :func:`render_chat`.
    """
    text = render_chat(tokenizer, messages, add_generation_prompt, tools, template_kwargs)
    return encode_rendered(tokenizer, text)


def encode_rendered(tokenizer, text: str) -> list[int]:
    """Token ids of a prompt a chat template wrote (no special tokens added)."""
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
