"""Structured outputs: constrained decoding (JSON Schema, regex, choice, grammar) and tool calls.

The pieces an engine calls, in order::

    backend = GrammarBackend(tokenizer, eos_token_ids)        # once per model
    spec = StructuredOutputs(json=schema)                     # per request: validated, ValueError
    matcher = backend.matcher(spec)                           # per sequence (cached compile + copy)
    step = StructuredBatch(backend.vocab_size)                # once per engine
    ...each decode step...
    step.fill([matcher or None for each row])                 # CPU, GIL released: overlap the forward
    step.apply_(logits)                                       # disallowed tokens -> -inf, in place
    matcher.accept_token(sampled); matcher.is_terminated()    # -> finish with reason "stop"

Tool calls: :func:`detect_tool_call_format` (from the chat template or a ``--tool-call-parser`` name),
:func:`build_tool_call_grammar` (tool_choice "required" / named / "auto", parallel or not) and
:func:`parse_tool_calls` / :class:`ToolCallStreamParser` to read the calls back.

Grammar library: llguidance, chosen over xgrammar by ``bench/structured_libs.py`` (results in
``bench/results/structured_libs.md``, measured on a shared 2-core CPU; ratios from the same run):

* It says what it cannot enforce. Of 20 JSON-Schema keywords probed, llguidance enforces 12 and
  refuses 8 at compile time with their names (uniqueItems, contains, not, if/then/else,
  propertyNames, dependentRequired, minContains, overlapping oneOf), which gives the 400 the issue
  asks for. xgrammar 0.2.9 compiles 9 of those 20 and then lets a breaking instance through without a
  word (allOf, oneOf, uniqueItems, contains, not, if/then/else, dependentRequired, minContains), and
  its default strict mode rejects valid instances of maxProperties / patternProperties schemas.
* Compile is cheap: a 20-property schema compiles (first mask included) in a few ms against
  xgrammar's tens of ms, and with the compiled template cached a new request starts in ~0.1 ms. Every
  new schema of a JSON-schema or tools request pays this before its first token.
* Per-step masks are slower than xgrammar's (xgrammar precomputes per-token masks at compile time),
  but stay far below a decode step: well under 1 ms per row on both vocabularies; the fill drops
  the GIL, so the engine runs it while the forward pass runs.
* Both were correct on the 10 schemas, the regexes, the choice and the Lark grammar; llguidance also
  reads GBNF and inlines JSON schemas into Lark (``%json``), which the tool-call grammars use.
"""

from lightinfer.structured.backend import GrammarBackend
from lightinfer.structured.bitmask import (
    StructuredBatch,
    allocate_token_bitmask,
    apply_token_bitmask_,
    unpack_bitmask,
)
from lightinfer.structured.matcher import GrammarMatcher
from lightinfer.structured.spec import JSON_WHITESPACE, StructuredOutputs, StructuredOutputsError
from lightinfer.structured.tool_formats import (
    FALLBACK_FORMAT,
    FORMATS,
    ToolCallFormat,
    detect_tool_call_format,
    get_tool_call_format,
)
from lightinfer.structured.tool_grammar import build_tool_call_grammar
from lightinfer.structured.tool_parser import (
    ParsedToolCalls,
    ToolCall,
    ToolCallStreamParser,
    parse_tool_calls,
)
from lightinfer.structured.tool_spec import (
    ToolChoice,
    ToolSpec,
    make_tool_call_id,
    parse_tool_choice,
    parse_tools,
)

__all__ = [
    "FALLBACK_FORMAT",
    "FORMATS",
    "JSON_WHITESPACE",
    "GrammarBackend",
    "GrammarMatcher",
    "ParsedToolCalls",
    "StructuredBatch",
    "StructuredOutputs",
    "StructuredOutputsError",
    "ToolCall",
    "ToolCallFormat",
    "ToolCallStreamParser",
    "ToolChoice",
    "ToolSpec",
    "allocate_token_bitmask",
    "apply_token_bitmask_",
    "build_tool_call_grammar",
    "detect_tool_call_format",
    "get_tool_call_format",
    "make_tool_call_id",
    "parse_tool_calls",
    "parse_tool_choice",
    "parse_tools",
    "unpack_bitmask",
]
