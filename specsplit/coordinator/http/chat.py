"""Chat messages → prompt token ids through the checkpoint's chat template (transformers' tokenizer, no torch)."""

from __future__ import annotations

from specsplit.client.errors import InvalidArgument


def chat_prompt_token_ids(tokenizer, messages: list[dict], *, add_generation_prompt: bool, **kwargs) -> list[int]:
    """The template's text for `messages`, tokenized without adding special tokens again (the template writes BOS
    where the checkpoint wants one), as vLLM does. A checkpoint without a template (`chat_template` in
    tokenizer_config.json, or chat_template.jinja) and a template that fails on these messages are InvalidArgument."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument(
            "this model's checkpoint has no chat template (chat_template in tokenizer_config.json, or "
            "chat_template.jinja): use /v1/completions with a prompt"
        )
    for m in messages:  # OpenAI's content parts: only text ones
        if isinstance(m.get("content"), list):
            parts = m["content"]
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in parts):
                raise InvalidArgument("only text content parts are supported")
            m["content"] = "".join(str(p.get("text", "")) for p in parts)
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except Exception as err:  # jinja's TemplateError, raise_exception() in the template, a bad kwarg
        raise InvalidArgument(f"the chat template refused the messages: {err}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))
