"""``POST /v1/responses`` bodies (OpenAI's Responses API). Unknown fields are ignored so real
clients work; unknown input item or content part types are refused (400 naming the item)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictStr, Tag

from app.api.schemas import (
    FunctionName,
    MaxTokens,
    Priority,
    SamplingFields,
    Text,
    TopLogprobs,
    UserName,
)
from app.models.protocol import SamplingParams

LOGPROBS_INCLUDE = "message.output_text.logprobs"

Id = Annotated[StrictStr, Field(min_length=1, max_length=256)]
# OpenAI's bounds on ``metadata``: at most 16 pairs, keys up to 64 characters, values up to 512
MetadataKey = Annotated[StrictStr, Field(max_length=64)]
MetadataValue = Annotated[StrictStr, Field(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)]


class TextPart(BaseModel):
    """A text content part (``input_text`` in a request, ``output_text`` echoed back)."""

    type: Literal["input_text", "output_text", "text"]
    text: Text


class MessageItem(BaseModel):
    """A message item; ``type`` may be left out (the SDK's "easy" input message)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[TextPart]


class FunctionCallItem(BaseModel):
    """A function call the model made earlier (sent back by the client with its output)."""

    type: Literal["function_call"]
    call_id: Id
    name: FunctionName
    arguments: Text


class FunctionCallOutputItem(BaseModel):
    """A function's result; ``call_id`` names a ``function_call`` item before it."""

    type: Literal["function_call_output"]
    call_id: Id
    output: Text | list[TextPart]


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _item_type,
        custom_error_type="unknown_item",
        custom_error_message="unknown input item type: expected message, function_call or "
        "function_call_output",
    ),
]


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (with ``name``,
    ``schema`` and ``strict``; the schema is always enforced, token by token)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: StrictStr = "text"
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def echo(self) -> dict[str, Any]:
        """As the response object reports it."""
        return self.model_dump(by_alias=True, exclude_none=True)


class TextOptions(BaseModel):
    format: TextFormat | None = None


class ToolItem(BaseModel):
    """A tool: a ``function`` (``name``, ``description``, ``parameters``: its arguments' JSON
    schema); any other type is a built-in tool, refused by the adapter, named."""

    model_config = ConfigDict(extra="allow")

    type: StrictStr
    name: FunctionName | None = None
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedChoice(BaseModel):
    type: Literal["function"]
    name: StrictStr


class ResponsesRequest(SamplingFields):
    """``POST /v1/responses``."""

    model: Text | None = None
    input: Text | Annotated[list[Item], Field(min_length=1)]
    instructions: Text | None = None
    max_output_tokens: MaxTokens | None = None
    stream: bool | None = False
    store: bool | None = True
    background: bool | None = False
    previous_response_id: Id | None = None
    tools: Annotated[list[ToolItem], Field(max_length=128)] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    metadata: Metadata | None = None
    include: Annotated[list[StrictStr], Field(max_length=16)] = Field(default_factory=list)
    top_logprobs: TopLogprobs | None = None
    user: UserName | None = None
    priority: Priority = Field(0, description="vLLM's extension: lower runs first")

    def logprobs_asked(self) -> int | None:
        """How many alternatives per token when ``include`` asks for the output text's log
        probabilities (``top_logprobs``, default 0), else None."""
        if LOGPROBS_INCLUDE in self.include:
            return self.top_logprobs or 0
        return None

    def sampling(self) -> SamplingParams:
        params = super().sampling()
        asked = self.logprobs_asked()
        return params if asked is None else dataclasses.replace(params, logprobs=asked)

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)
