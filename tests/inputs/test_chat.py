"""Chat messages through the template (render_chat), and the UI's context trimming (fit_context)."""

from __future__ import annotations

import json

import pytest

from lightinfer.inputs import InputError, fit_context, normalize_messages, render_chat
from tests.serving.serving_fakes import IM_START, FakeTokenizer


def test_render_chat_is_the_template_text_and_its_ids() -> None:
    tok = FakeTokenizer()
    p = render_chat(tok, [{"role": "developer", "content": "be brief"},
                          {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "you"}]}])
    assert p.prompt == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi you<|im_end|>\n" \
                       "<|im_start|>assistant\n"  # developer is OpenAI's name for system; text parts joined
    assert p.prompt_token_ids == tok.encode(p.prompt, add_special_tokens=False) and p.prompt_token_ids[0] == IM_START
    no_header = render_chat(tok, [{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert not no_header.prompt.endswith("assistant\n")


def test_template_variables_and_tools_reach_the_template() -> None:
    seen = {}

    class Recording(FakeTokenizer):
        chat_template = "chatml with tools"  # its own cache entry of template_renders_tools

        def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, **kwargs):
            seen.update(kwargs)
            text = super().apply_chat_template(messages, add_generation_prompt, tokenize=False)
            text = json.dumps(kwargs.get("tools")) + text  # a template that renders tools
            return self.encode(text) if tokenize else text

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    render_chat(Recording(), [{"role": "user", "content": "hi"}], tools=tools,
                chat_template_kwargs={"enable_thinking": False})
    assert seen == {"tools": tools, "enable_thinking": False}


@pytest.mark.parametrize("messages, needle", [
    ("hi", "a conversation is a non-empty list"),
    ([], "got an empty one"),
    ([{"role": "user"}], "needs 'role' and 'content'"),
    ([{"role": "wizard", "content": "x"}], "role 'wizard' is not one of"),
    ([{"role": "user", "content": 5}], "content must be a string or a list of text blocks"),
    ([{"role": "user", "content": "a\ud800"}], "user message is not valid Unicode"),
])
def test_bad_messages_are_clear_errors(messages, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        normalize_messages(messages)
    with pytest.raises(ValueError, match=needle):
        render_chat(FakeTokenizer(), messages)


def test_no_tokenizer_no_template_and_a_refusing_template() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="no tokenizer"):
        render_chat(None, msgs)

    class NoTemplate(FakeTokenizer):
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        render_chat(NoTemplate(), msgs)

    class Strict(FakeTokenizer):
        def apply_chat_template(self, *args, **kwargs):
            raise RuntimeError("Conversation roles must alternate user/assistant")

    with pytest.raises(InputError, match="the chat template rejected the messages: Conversation roles") as e:
        render_chat(Strict(), msgs)
    assert e.value.param == "messages"


def test_fit_context_long_conversation_trimmed_from_oldest_turn() -> None:
    tok = FakeTokenizer()
    turns = []
    for i in range(20):
        turns += [{"role": "user", "content": f"question {i} " + "x" * 40},
                  {"role": "assistant", "content": f"answer {i} " + "y" * 40}]
    turns.append({"role": "user", "content": "last question"})
    prompt, dropped, max_new = fit_context(tok, "be brief", turns, max_model_len=400, max_new_tokens=100)
    ids = prompt.prompt_token_ids
    assert dropped > 0 and dropped % 2 == 0  # whole (user, assistant) turns
    assert len(ids) + max_new <= 400 and max_new == 100
    text = tok.decode(ids)
    assert "last question" in text and "be brief" in text and "question 0 " not in text


def test_fit_context_message_too_long_alone_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="context holds 100"):
        fit_context(FakeTokenizer(), "", [{"role": "user", "content": "z" * 500}], 100, 10)
    prompt, dropped, max_new = fit_context(FakeTokenizer(), "", [{"role": "user", "content": "z" * 50}], 100, 90)
    ids = prompt.prompt_token_ids
    assert dropped == 0 and len(ids) + max_new == 100  # the reply budget shrinks to what fits




def test_a_template_that_trips_the_sandbox_is_one_clear_error(tmp_path, capsys) -> None:
    """Issue 19 item 7: a chat template reaching for ``__class__`` (Jinja's sandbox raises SecurityError) is
    refused as the template's fault, in one line, from every front end; no traceback."""
    from transformers import AutoTokenizer

    from lightinfer.cli import main
    from tests.conftest import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "m")
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}{{ m.content }}{% endfor %}"
    (folder / "chat_template.jinja").write_text(evil)
    tok = AutoTokenizer.from_pretrained(folder)
    with pytest.raises(InputError, match="the chat template rejected the messages: access to attribute '__class__'"):
        render_chat(tok, [{"role": "user", "content": "hi"}])
    assert main(["generate", str(folder), "--chat", "--prompt", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "error: the chat template rejected the messages" in err and "Traceback" not in err
