"""The input layer: prompts, chat messages and settings become checked engine requests, once.

Front ends (``LLM``, the OpenAI API, the chat UI, the CLI) call it; the engine takes its
:class:`EngineRequest` as it is. It sits below the engine in the import order and knows the
model only through its tokenizer, vocabulary size and context length.
"""

from lightinfer.inputs.chat import CHAT_ROLES, Message, fit_context, normalize_messages, render_chat
from lightinfer.inputs.data import EngineRequest, InputError, PoolingParams, PromptType, TokenizedPrompt
from lightinfer.inputs.pooling import PoolerConfig
from lightinfer.inputs.processor import InputProcessor
from lightinfer.inputs.text import check_text, message_text

__all__ = [
    "CHAT_ROLES", "EngineRequest", "InputError", "InputProcessor", "Message", "PoolerConfig", "PoolingParams", "PromptType",
    "TokenizedPrompt",
    "check_text", "fit_context", "message_text", "normalize_messages", "render_chat",
]
