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

Grammar library: llguidance, chosen over xgrammar by ``bench/structured_libs.py`` (at commit e1f3011, results in
its ``bench/results/structured_libs.md``: a shared, loaded 2-core CPU, both libraries interleaved in
one run; read the ratios, not the absolute times; summed up in ``docs/performance.md``):

* It says what it cannot enforce. Of 20 JSON-Schema keywords probed, llguidance enforces 12 and
  refuses the other 8 at compile time, naming them (uniqueItems, contains, minContains, not,
  if/then/else, propertyNames, dependentRequired, overlapping oneOf): that is the 400 the API owes
  for "an unsupported keyword". xgrammar 0.2.9 silently ignores 8 of the 20 (compiles them, then
  lets a breaking instance through: allOf, overlapping oneOf, uniqueItems, contains, minContains,
  not, if/then/else, dependentRequired); its default strict mode also rejects valid instances of
  maxProperties / patternProperties schemas and refuses minProperties.
* Compile is 16-40x cheaper: a 20-property schema compiles (first mask included) in ~2 ms on
  SmolLM2's 49k vocabulary and ~2.4 ms on a 150k one, against ~32 ms and ~96 ms for xgrammar, which
  precomputes token masks (three runs on the loaded machine: 16-24x at 49k, 24-39x at 150k). Every
  request with a new schema (or new tools) pays this before its first token; with the compiled
  template cached here a request starts in ~0.03 ms.
* Per-step masks are 1.4-3x slower than xgrammar's (median per step, 32 rows: 0.41 vs 0.17 ms at
  49k, 0.63 vs 0.45 ms at 150k; one row: 0.03 vs 0.01 ms and 0.07 vs 0.03 ms) with a longer tail
  (p90 at 32 rows 1.7 / 8 ms), yet far below a decode step; the fill drops the GIL, so the engine
  can run it during the forward. Both libraries' threaded batch fill was 5-22x slower than a plain
  loop on this 2-core machine (hence :class:`StructuredBatch`'s default).
* Both were correct on the 10 schemas, 3 regexes, a choice and a Lark grammar: fixed instances
  accepted / rejected, and every random-logit generation that finished was valid (with the
  libraries' default unbounded JSON whitespace a few looped on blank lines until the token limit,
  under both; hence :data:`JSON_WHITESPACE`, and likewise numbers are bounded to float64's digits
  and free nesting to :data:`~lightinfer.structured.spec.JSON_MAX_FREE_NESTING` levels). llguidance also reads GBNF and inlines JSON schemas
  into Lark (``%json``), which the tool-call grammars use.
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
