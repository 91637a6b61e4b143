"""JSON Schema checks for tools: a server's input schema at listing, the model's arguments at call.

`jsonschema` comes with the `mcp` SDK (its own dependency), so it is always there with MCP. The
validator is the one the schema names in `$schema` (draft 2020-12 when it names none, as MCP's
spec says), with `format` not enforced (as the SDK's servers do not enforce it either).
"""
from __future__ import annotations

from typing import Any, Optional

MAX_ERROR_CHARS = 300


def _validator(schema: dict):
    from jsonschema.validators import validator_for
    from jsonschema import Draft202012Validator
    return validator_for(schema, default=Draft202012Validator)


def schema_problem(schema: Any) -> Optional[str]:
    """Why a tool's input schema cannot be used, or None. It must be a valid JSON Schema for an
    object (a tool's arguments are named: Gemma's template and grammar declare them as properties)."""
    from jsonschema.exceptions import SchemaError
    if not isinstance(schema, dict):
        return "is not a JSON object"
    try:
        _validator(schema).check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        return f"is not valid JSON Schema: {e.message[:MAX_ERROR_CHARS]}" + (f" (at {where})" if where else "")
    except Exception as e:  # noqa: BLE001 - a schema that breaks the checker is refused too, in one line
        return f"cannot be checked: {type(e).__name__}"
    if schema.get("type", "object") != "object":
        return f"describes {schema.get('type')!r} arguments, not an object of named ones"
    return None


def argument_problem(schema: dict, arguments: Any) -> Optional[str]:
    """Why the model's arguments fail the tool's schema (the most relevant error), or None."""
    from jsonschema.exceptions import best_match
    if not isinstance(arguments, dict):
        return f"the arguments must be a JSON object, not {type(arguments).__name__}"
    try:
        error = best_match(_validator(schema)(schema).iter_errors(arguments))
    except Exception:  # noqa: BLE001 - a `$ref` we cannot resolve: the server checks its own arguments
        return None
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return (f"at {where}: " if where else "") + error.message[:MAX_ERROR_CHARS]
