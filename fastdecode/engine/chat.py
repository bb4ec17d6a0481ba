"""Chat conversations as vLLM takes them, made ready for the model's chat template.

A message's `content` is a string, or a list of parts of which fastdecode serves the text ones
(`{"type": "text", "text": ...}`). With the content format "string" (vLLM's choice for the usual
templates) the text parts are joined with newlines, as vLLM joins them; with "openai" the template
gets the parts themselves. A `chat_template` is the template's text or a file that holds it.
"""
from __future__ import annotations

import os

CONTENT_FORMATS = ("auto", "string", "openai")
_JINJA_CHARS = "{}\n"        # a template has these; a file path does not


def joined_text(parts) -> str:
    """Text parts joined as vLLM joins them."""
    return "\n".join(p["text"] if isinstance(p, dict) else p.text for p in parts)


def conversations(messages) -> list[list[dict]]:
    """One conversation (a list of messages) or a list of them -> a list of conversations."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} messages, or a list of such lists")
    if isinstance(messages[0], dict):
        return [list(messages)]
    return [list(c) for c in messages]


def template_messages(conversation: list[dict], content_format: str = "auto", where: str = "messages") -> list[dict]:
    """The conversation as the chat template takes it; ValueError naming the message or part at fault."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, "
                         f"got {content_format!r}")
    if not isinstance(conversation, list) or not conversation:
        raise ValueError(f"{where} must be a non-empty list of {{role, content}} messages")
    out = []
    for i, message in enumerate(conversation):
        at = f"{where}[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{at} must be a message: a dict with a string 'role'")
        content = message.get("content")
        if content is None or isinstance(content, str):
            parts = None if content is None else [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = [_text_part(part, f"{at}.content[{k}]") for k, part in enumerate(content)]
        else:
            raise ValueError(f"{at}.content must be a string or a list of text parts, got {type(content).__name__}")
        if content_format == "openai":
            text = parts if parts is not None else []
        else:
            text = "" if parts is None else joined_text(parts)
        out.append({**message, "content": text})
    return out


def _text_part(part, at: str) -> dict:
    if not isinstance(part, dict):
        raise ValueError(f"{at} must be a content part ({{'type': 'text', 'text': ...}}), got {type(part).__name__}")
    kind = part.get("type")
    if kind != "text":
        raise ValueError(f"{at}: content parts of type {kind!r} are not supported by fastdecode (text only)")
    if not isinstance(part.get("text"), str):
        raise ValueError(f"{at}.text must be a string")
    return {"type": "text", "text": part["text"]}


def load_chat_template(template: str | None) -> str | None:
    """vLLM's reading of a chat_template: a file that holds the template, else the template itself."""
    if template is None:
        return None
    if not isinstance(template, str) or not template:
        raise ValueError("chat_template must be a non-empty string: a Jinja template or a file holding one")
    if not any(c in template for c in _JINJA_CHARS):
        try:
            with open(os.path.expanduser(template)) as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"chat_template {template!r} looks like a file path but cannot be read "
                             f"({e.strerror})") from None
    return template
