"""Which top-level request-body fields the OpenAI routes take, and the values a field that has no
effect here may carry (issue 19: every field is honoured or refused, none silently ignored).

The request models (jaxserve/server/openai_models.py) declare each route's fields: those it honours
plus the ones the two tables below name, checked by the table's rule:
- ACCEPTED_NO_EFFECT: fields that by their definition do not change the tokens (an end-user id,
  billing metadata, a cache key), or SGLang's reasoning switches where no reasoning parser runs.
  Accepted, type-checked.
- REFUSED_UNLESS_UNUSED: features this server does not have (audio, predicted outputs, hidden
  states, ...). Only the value that means "not used" is accepted, because routers and clients
  send the defaults; any other value is a 400 rather than a silently different answer.
A key in neither the route's honoured fields nor these tables is a 400 naming it (vLLM ignores
unknown fields; we do not, so a typo or an unsupported feature never goes unnoticed).
"""

from __future__ import annotations

from typing import Any, Callable

Check = Callable[[Any], bool]


def _one_of(*values: Any) -> Check:
    """Exactly one of `values` (type too: `0` is not `False`, `1` is not `True`)."""
    return lambda v: any(v == x and type(v) is type(x) for x in values)


def _null_or(kind: type) -> Check:
    return lambda v: v is None or (isinstance(v, kind) and not isinstance(v, bool))


def _null_or_bool(v: Any) -> bool:
    return v is None or isinstance(v, bool)


# name -> (the check, what it must be: the 400's wording), and the routes it belongs to.
ACCEPTED_NO_EFFECT: dict[str, tuple[Check, str]] = {
    "user": (_null_or(str), "a string"),  # OpenAI's end-user id for abuse monitoring
    "store": (_one_of(None, False), "false or null (this server stores no completions)"),
    "metadata": (_null_or(dict), "an object"),  # tags for stored completions: nothing is stored
    "service_tier": (_one_of(None, "auto", "default"), "'auto', 'default' or null (one tier here)"),
    "prompt_cache_key": (_null_or(str), "a string"),  # prefix caching is automatic
    "safety_identifier": (_null_or(str), "a string"),  # OpenAI's newer `user`
    "separate_reasoning": (_null_or_bool, "a boolean"),  # SGLang's: no reasoning parser runs here
    "stream_reasoning": (_null_or_bool, "a boolean"),
}

REFUSED_UNLESS_UNUSED: dict[str, tuple[Check, str]] = {
    "audio": (_one_of(None), "null (no audio output)"),
    "prediction": (_one_of(None), "null (no predicted outputs)"),
    "web_search_options": (_one_of(None), "null (no web search)"),
    "reasoning_effort": (_one_of(None), "null (no reasoning control)"),
    "verbosity": (_one_of(None), "null (no verbosity control)"),
    "modalities": (lambda v: v is None or v == ["text"], "null or [\"text\"] (text output only)"),
    "continue_final_message": (_one_of(None, False), "false or null (not supported)"),
    "include_reasoning": (_one_of(None, True), "true or null (no reasoning is ever removed)"),
    "prompt_cache_retention": (_one_of(None, "in-memory"), "'in-memory' or null (the only retention here)"),
    "no_stop_trim": (_one_of(None, False), "false or null (stop strings are always trimmed)"),
    "return_hidden_states": (_one_of(None, False), "false or null (hidden states are not returned)"),
    # The detokenizer (tokenizers' DecodeStream) has no such switch: special tokens are never spaced.
    "spaces_between_special_tokens": (_one_of(None, True), "true or null (not configurable)"),
    "suffix": (_one_of(None, ""), "empty or null (no fill-in-the-middle)"),
    # (tools, tool_choice, parallel_tool_calls are honoured: server/tool_calls.py)
    "functions": (_one_of(None, []), "empty or null (deprecated: use tools)"),
    "function_call": (_one_of(None, "none"), "'none' or null (deprecated: use tool_choice)"),
    # Completions' own fields, kept known on chat: refused there unless unused, as before.
    "best_of": (_one_of(None, 1), "1 or null (OpenAI's chat completions have no best_of; /v1/completions has)"),
    "echo": (_one_of(None, False), "false or null (echo is only supported by /v1/completions)"),
}

# Which of the above each route takes: OpenAI's chat-only fields stay off completions.
COMPLETIONS_EXTRA = frozenset({"user", "no_stop_trim", "return_hidden_states", "spaces_between_special_tokens",
                               "suffix"})
CHAT_EXTRA = (frozenset(ACCEPTED_NO_EFFECT) | frozenset(REFUSED_UNLESS_UNUSED)) - {"suffix"}
# A field's rule, whichever table holds it.
RULES: dict[str, tuple[Check, str]] = {**ACCEPTED_NO_EFFECT, **REFUSED_UNLESS_UNUSED}

# stream_options: key -> (the check, what it must be).
STREAM_OPTIONS: dict[str, tuple[Check, str]] = {
    "include_usage": (_null_or_bool, "a boolean"),
    "continuous_usage_stats": (_null_or_bool, "a boolean"),  # vLLM's
    "include_obfuscation": (_one_of(None, False), "false or null (no obfuscation padding is sent)"),
}


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
