"""Request bodies. Integers are strict (``"5"`` and ``5.0`` are refused), unknown OpenAI fields
are ignored so real clients work; semantic checks (vocabulary, context length) live in
``app.serving``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from app.models.protocol import SamplingParams


def _unicode_text(text: str) -> str:
    """JSON may carry lone surrogates ("\\ud800") that no UTF-8 text can hold: refuse them here,
    before they reach the tokenizer or a response."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = text[err.start]
        message = f"contains a lone surrogate {bad!r} at index {err.start}, not text"
        raise ValueError(message) from None
    return text


Text = Annotated[StrictStr, AfterValidator(_unicode_text)]
NonEmptyText = Annotated[StrictStr, Field(min_length=1), AfterValidator(_unicode_text)]
TokenId = Annotated[StrictInt, Field(ge=0)]
RequestId = Annotated[
    StrictStr, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:\-]+$")
]
MaxTokens = Annotated[StrictInt, Field(ge=0)]
Priority = Annotated[StrictInt, Field(ge=-1000, le=1000)]
UserName = Annotated[StrictStr, Field(max_length=256), AfterValidator(_unicode_text)]


class SamplingFields(BaseModel):
    """Per-request sampling (vLLM's names and ranges). The mocks ignore them; a real model
    honours them. An omitted ``temperature`` means the model's default."""

    temperature: Annotated[float, Field(ge=0, le=100)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = Field(None, description="-1 or 0: off")
    min_p: Annotated[float, Field(ge=0, le=1)] | None = Field(None, description="0: off")
    seed: StrictInt | None = Field(None, description="same seed, same tokens, whatever the batch")

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            seed=self.seed,
            min_p=0.0 if self.min_p is None else self.min_p,
        )


class GenerateRequest(SamplingFields):
    """``POST /generate``: the native API."""

    model_config = ConfigDict(extra="forbid")

    prompt: Annotated[list[TokenId], Field(min_length=1)] | NonEmptyText
    max_tokens: MaxTokens | None = Field(None, description="generated tokens at most")
    stream: StrictBool = True
    ignore_eos: StrictBool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)
    request_id: RequestId | None = Field(None, description="client id; a live duplicate: 409")
    priority: Priority = Field(0, description="lower runs first under --policy priority")
    user: UserName | None = Field(None, description="end user, for fairness (API keys win)")


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


NEUTRAL_VALUES: dict[str, tuple[object, ...]] = {
    "echo": (None, False),
    "logprobs": (None, False),  # 0 still asks completions for the sampled token's logprob
    "top_logprobs": (None, 0),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
}


class OpenAIParams(SamplingFields):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    max_tokens: MaxTokens | None = None
    stream: StrictBool | None = False  # null: the default, as OpenAI accepts
    stream_options: StreamOptions | None = None
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=16)] | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)
    ignore_eos: StrictBool = False
    n: Literal[1] | None = 1
    priority: Priority = Field(0, description="vLLM's extension: lower runs first")
    user: UserName | None = None

    # Fields that would change the response's shape (echoed prompt, log-probabilities, tool
    # calls, JSON mode): this server cannot honour them, so a value other than the neutral one
    # is refused (see ``unsupported``) rather than silently answered without them.
    echo: object = None
    logprobs: object = None
    top_logprobs: object = None
    suffix: object = None
    best_of: object = None
    tools: object = None
    tool_choice: object = None
    functions: object = None
    function_call: object = None
    response_format: object = None

    def unsupported(self) -> str | None:
        """The first field set to a value this server cannot honour, or None."""
        for name, neutral in NEUTRAL_VALUES.items():
            value = getattr(self, name)
            # by type as well as value: 0 == False, but only False is a neutral logprobs
            if not any(type(value) is type(n) and value == n for n in neutral):
                return name
        return None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(OpenAIParams):
    prompt: (
        NonEmptyText
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Text], Field(min_length=1, max_length=1)]
        | Annotated[list[list[TokenId]], Field(min_length=1, max_length=1)]
    )


class ContentPart(BaseModel):
    """One part of a message's content; only text parts carry text (others, such as images,
    are accepted and read as empty)."""

    model_config = ConfigDict(extra="ignore")

    type: StrictStr = "text"
    text: Text = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(OpenAIParams):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
