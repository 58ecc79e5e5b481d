"""``POST /v1/messages`` bodies (Anthropic's Messages API). Unknown fields are ignored, as on
the OpenAI routes, so real clients work; unknown content block types are refused (400 naming
the block); ``max_tokens`` is required, as Anthropic requires it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictStr

from app.api.schemas import FunctionName, NonEmptyText, Priority, Text, UserName
from app.models.protocol import SamplingParams


class TextBlock(BaseModel):
    type: Literal["text"]
    text: Text


class ToolUseBlock(BaseModel):
    """A tool call the assistant made (in an assistant message)."""

    type: Literal["tool_use"]
    id: Annotated[StrictStr, Field(min_length=1)]
    name: FunctionName  # rendered into the prompt: the tool names' pattern, as OpenAI's
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    """A tool's answer (in a user message); ``tool_use_id`` names an earlier ``tool_use``."""

    type: Literal["tool_result"]
    tool_use_id: Annotated[StrictStr, Field(min_length=1)]
    content: Text | list[TextBlock] = ""
    is_error: bool = False


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(BaseModel):
    """A turn; ``system`` too (vLLM takes it as a system turn where it stands)."""

    role: Literal["user", "assistant", "system"]
    content: Text | Annotated[list[Block], Field(min_length=1)]

    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock]:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class Metadata(BaseModel):
    user_id: UserName | None = None


class ToolDef(BaseModel):
    """A client tool (``input_schema``: its input's JSON schema). Anthropic's server tools
    (a ``type`` such as ``web_search_20250305``) are refused by the adapter, named."""

    type: StrictStr | None = None
    name: FunctionName
    description: StrictStr | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoiceDef(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None  # with "tool"
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: the prompt part of a messages request."""

    model: Text | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Text | list[TextBlock] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=128)] = Field(default_factory=list)
    tool_choice: ToolChoiceDef | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``. Sampling ranges are Anthropic's (temperature 0-1), and so is
    ``max_tokens`` >= 1; integers are read as on the OpenAI routes (pydantic's lax mode, as
    vLLM's schema of this route: ``"5"`` and ``5.0`` are 5)."""

    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[NonEmptyText], Field(max_length=16)] = Field(
        default_factory=list
    )
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    priority: Priority = Field(0, description="slotserve's extension: lower runs first")

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
        )

    def user(self) -> str | None:
        return self.metadata.user_id if self.metadata is not None else None
