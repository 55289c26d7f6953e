"""The structured-output fields of an HTTP request body, mapped onto StructuredOutputsParams.

Three spellings reach the same constraint: OpenAI's `response_format` (`json_object`, or
`json_schema` with `{"name", "schema", "strict"}`), vLLM's `structured_outputs` extra body, and
vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. One request may
use only one of them. Errors are InvalidRequest naming the field the client sent.
"""

from __future__ import annotations

from typing import Any

from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.server.common import InvalidRequest

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# Every body field this module reads (the routes' allowlists take them from here).
FIELDS = ("response_format", "structured_outputs", *_GUIDED, "guided_whitespace_pattern")


def _response_format(value: Any) -> StructuredOutputsParams | None:
    if not isinstance(value, dict):
        raise InvalidRequest("response_format must be an object", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise InvalidRequest(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                             "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest("response_format.json_schema must be an object with a name and a schema",
                             "response_format")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise InvalidRequest("response_format.json_schema.name must be a non-empty string", "response_format")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise InvalidRequest("response_format.json_schema.strict must be a boolean", "response_format")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's schema is optional: any JSON object then
        return StructuredOutputsParams(json_object=True)
    if not isinstance(schema, dict):
        raise InvalidRequest("response_format.json_schema.schema must be a JSON schema (an object)",
                             "response_format")
    return StructuredOutputsParams(json=schema)


def structured_outputs_from_body(body: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the body field it came from), or (None, None) without one."""
    given = [k for k in ("response_format", "structured_outputs", *_GUIDED) if body.get(k) is not None]
    if body.get("guided_whitespace_pattern") is not None:
        raise InvalidRequest("guided_whitespace_pattern is not supported by this server", "guided_whitespace_pattern")
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "text":  # OpenAI's default: no constraint
        given.remove("response_format")
    if not given:
        return None, None
    if len(given) > 1:
        raise InvalidRequest(f"give one structured output field, got {', '.join(given)}", given[1])
    name = given[0]
    value = body[name]
    try:
        if name == "response_format":
            return _response_format(value), name
        if name == "structured_outputs":
            return StructuredOutputsParams.from_dict(value), name
        return StructuredOutputsParams(**{_GUIDED[name]: value}), name
    except (ValueError, TypeError) as exc:
        if isinstance(exc, InvalidRequest):
            raise
        raise InvalidRequest(f"{name}: {exc}", name) from None
