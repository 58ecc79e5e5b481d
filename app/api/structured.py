"""Structured outputs in the OpenAI API: ``response_format`` (OpenAI's ``json_object`` and
``json_schema``) and vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``,
``grammar``, ``json_object``) as request fields, turned into the protocol-neutral
``Constraint`` (app/structured). Whether it compiles is checked by ``Serving.prepare`` (400 with
the field named)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from app.api.errors import InvalidField
from app.structured.constraint import Constraint


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``. ``strict`` is accepted either way: the schema is always
    enforced (every token is masked by it)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: StrictStr | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its constraint fields (others ignored)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    grammar: StrictStr | None = None
    json_object: bool | None = None
    # vLLM's knobs this server does not honour: refused when set (see ``_from_structured_outputs``)
    whitespace_pattern: object = None
    structural_tag: object = None
    disable_fallback: object = None
    disable_any_whitespace: object = None
    disable_additional_properties: object = None


UNHONOURED = (
    "whitespace_pattern",
    "structural_tag",
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
)


def requested_constraint(
    response_format: ResponseFormat | None, structured: StructuredOutputs | None
) -> tuple[Constraint | None, str]:
    """The constraint a request asks for and the field that asked (for its errors)."""
    from_format = _from_response_format(response_format)
    from_vllm = _from_structured_outputs(structured)
    if from_format is not None and from_vllm is not None:
        raise InvalidField("set either response_format or structured_outputs, not both",
                           param="structured_outputs", code="invalid_structured_outputs"
                           )  # fmt: skip
    if from_vllm is not None:
        return from_vllm[0], f"structured_outputs.{from_vllm[1]}"
    return from_format, "response_format"


def _from_response_format(fmt: ResponseFormat | None) -> Constraint | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint.json_object()
    if fmt.json_schema is None:  # vLLM's check names the format
        raise InvalidField("response_format.json_schema is required with type json_schema",
                           param="response_format.json_schema", code="missing",
                           shown="response_format")  # fmt: skip
    schema = fmt.json_schema.schema_
    return Constraint.json_schema(schema if schema is not None else {})


def _from_structured_outputs(spec: StructuredOutputs | None) -> tuple[Constraint, str] | None:
    """The constraint and the name of the field that set it."""
    if spec is None:
        return None
    for knob in UNHONOURED:
        if getattr(spec, knob) not in (None, False):
            raise InvalidField(f"structured_outputs.{knob} is not supported by this server; "
                               "leave it unset", param=f"structured_outputs.{knob}",
                               code="unsupported_parameter")  # fmt: skip
    chosen: list[tuple[Constraint, str]] = []
    if spec.json_ is not None:
        chosen.append((Constraint.json_schema(_schema(spec.json_)), "json"))
    if spec.regex is not None:
        chosen.append((Constraint.regex(spec.regex), "regex"))
    if spec.choice is not None:
        chosen.append((Constraint.choice(spec.choice), "choice"))
    if spec.grammar is not None:
        chosen.append((Constraint.grammar(spec.grammar), "grammar"))
    if spec.json_object:
        chosen.append((Constraint.json_object(), "json_object"))
    if len(chosen) != 1:
        raise InvalidField("structured_outputs must set exactly one of json, regex, choice, "
                           f"grammar, json_object ({len(chosen)} set)", param="structured_outputs",
                           code="invalid_structured_outputs")  # fmt: skip
    return chosen[0]


def _schema(value: dict[str, Any] | str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        schema = json.loads(value)
    except ValueError as err:
        message = f"structured_outputs.json is not valid JSON: {err}"
        raise InvalidField(message, param="structured_outputs.json",
                           code="invalid_json_schema") from None  # fmt: skip
    if not isinstance(schema, dict):
        raise InvalidField("structured_outputs.json must be a JSON object (a schema)",
                           param="structured_outputs.json", code="invalid_json_schema")  # fmt: skip
    return schema
