"""Request bodies. Integers and booleans are read as vLLM's schema reads them (pydantic's lax
mode: ``"5"`` and ``5.0`` are 5, ``5.5`` and ``"five"`` are refused; ``"false"``, ``0`` and
``"no"`` are false, ``2`` is refused), unknown fields are ignored (pydantic's
default; a body that refuses them sets ``extra="forbid"``) so real clients work; semantic checks
(vocabulary, context length) live in ``app.serving``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Protocol

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictStr,
    model_validator,
)

from app.api.errors import InvalidField
from app.api.structured import ResponseFormat, StructuredOutputs
from app.models.protocol import SamplingParams

# --- tools (app/api/tools.py reads them) ----------------------------------------------------------

# a tool's name, wherever a client sends one that is rendered into the prompt (a tool, an
# earlier call), on every protocol: OpenAI's pattern, so no name can close a tool-call block
FunctionName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class FunctionDef(BaseModel):
    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    name: FunctionName  # rendered into the prompt, as a tool's name is
    arguments: StrictStr


class MessageToolCall(BaseModel):
    """An earlier assistant message's call, as the client sends it back."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: CalledFunction


ToolChoiceField = Literal["none", "auto", "required"] | NamedToolChoice


# --- bodies ---------------------------------------------------------------------------------------


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


class _TextPart(Protocol):
    text: str


def joined_text(content: str | Sequence[_TextPart] | None) -> str:
    """A content field's text: the string itself, or its parts' texts joined (None: "")."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)


Text = Annotated[StrictStr, AfterValidator(_unicode_text)]
NonEmptyText = Annotated[StrictStr, Field(min_length=1), AfterValidator(_unicode_text)]
TokenId = Annotated[int, Field(ge=0)]
RequestId = Annotated[
    StrictStr, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:\-]+$")
]
MaxTokens = Annotated[int, Field(ge=0)]
Priority = Annotated[int, Field(ge=-1000, le=1000)]
UserName = Annotated[StrictStr, Field(max_length=256), AfterValidator(_unicode_text)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
TokenKey = Annotated[StrictStr, Field(pattern=r"^[0-9]{1,9}$")]  # a token id as a JSON key
Bias = Annotated[float, Field(ge=-100, le=100)]
TopLogprobs = Annotated[int, Field(ge=0, le=20)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # 64 bits, as vLLM's schema bounds it
MAX_LOGIT_BIAS = 1024  # entries
MAX_BAD_WORDS = 64


class SamplingFields(BaseModel):
    """Per-request sampling (vLLM's names and ranges). The mocks ignore them; a real model
    honours them. An omitted ``temperature`` means the model's default."""

    temperature: Annotated[float, Field(ge=0, le=2)] | None = None  # vLLM's (and OpenAI's)
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = Field(None, description="-1 or 0: off")
    min_p: Annotated[float, Field(ge=0, le=1)] | None = Field(None, description="0: off")
    seed: Seed | None = Field(None, description="same seed, same tokens, whatever the batch")
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    logit_bias: Annotated[dict[TokenKey, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    bad_words: Annotated[list[NonEmptyText], Field(max_length=MAX_BAD_WORDS)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None

    def sampling(self) -> SamplingParams:
        """The sampling parameters (``bad_words`` are text: the server tokenizes them)."""
        allowed = self.allowed_token_ids
        return SamplingParams(
            temperature=self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            seed=self.seed,
            min_p=0.0 if self.min_p is None else self.min_p,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
            min_tokens=self.min_tokens or 0,
            allowed_token_ids=None if allowed is None else tuple(sorted(set(allowed))),
        )


class GenerateRequest(SamplingFields):
    """``POST /generate``: the native API."""

    model_config = ConfigDict(extra="forbid")

    prompt: Annotated[list[TokenId], Field(min_length=1)] | NonEmptyText
    max_tokens: MaxTokens | None = Field(None, description="generated tokens at most")
    stream: bool = True
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)
    request_id: RequestId | None = Field(None, description="client id; a live duplicate: 409")
    priority: Priority = Field(0, description="lower runs first under --policy priority")
    user: UserName | None = Field(None, description="end user, for fairness (API keys win)")


class StreamOptions(BaseModel):
    include_usage: bool = False


NEUTRAL_VALUES: dict[str, tuple[object, ...]] = {
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    # vLLM's legacy structured-output fields (removed there): refused, not silently ignored
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_json_object": (None, False),
}


class OpenAIParams(SamplingFields):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model: Text | None = None
    max_tokens: MaxTokens | None = None
    stream: bool | None = False  # null: the default, as OpenAI accepts
    stream_options: StreamOptions | None = None
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=16)] | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1)] | None = Field(1, description="choices (--max-n)")
    best_of: Annotated[int, Field(ge=1)] | None = Field(None, description="must equal n")
    priority: Priority = Field(0, description="vLLM's extension: lower runs first")
    user: UserName | None = None
    prompt_logprobs: TopLogprobs | None = Field(None, description="vLLM's: per prompt token")
    # vLLM's P/D disaggregation parameters: checked by app/api/kv_transfer.py (400 naming the
    # field) against the server's --kv-transfer-config role
    kv_transfer_params: object = Field(None, description="vLLM's: prefill/decode disaggregation")

    # Fields that would change the response's shape (suffix, tool calls, JSON mode): this
    # server cannot honour them, so a value other than the neutral one is refused (see
    # ``unsupported``) rather than silently answered without them.
    suffix: object = None
    functions: object = None
    function_call: object = None
    guided_json: object = None
    guided_regex: object = None
    guided_choice: object = None
    guided_grammar: object = None
    guided_json_object: object = None
    # structured outputs (app/api/structured.py): OpenAI's and vLLM's request fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

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

    def top_logprobs_asked(self) -> int | None:
        """Alternatives per sampled token (0: the sampled token's only), None: no logprobs."""
        return None

    def sampling(self) -> SamplingParams:
        params = super().sampling()
        logprobs, prompt = self.top_logprobs_asked(), self.prompt_logprobs
        if logprobs is None and prompt is None:
            return params
        return dataclasses.replace(params, logprobs=logprobs, prompt_logprobs=prompt)


MAX_PROMPTS = 256  # prompts in one completion request (each answered by n choices)


class CompletionRequest(OpenAIParams):
    logprobs: TopLogprobs | None = Field(None, description="log probabilities of N alternatives")
    echo: bool | None = False

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @model_validator(mode="before")
    @classmethod
    def _prompt_given(cls, data: Any) -> Any:
        """A missing or null ``prompt`` is refused as vLLM refuses it, by its own check before
        the schema's (a ``BadRequestError`` naming ``prompt``, not the schema's error)."""
        if isinstance(data, dict) and data.get("prompt") is None:
            raise InvalidField("prompt must be provided and non-empty", param="prompt",
                               code="missing")  # fmt: skip
        return data

    @model_validator(mode="after")
    def _echo_logprobs(self) -> CompletionRequest:
        """With ``echo``, ``logprobs`` covers the prompt's tokens too (as OpenAI's did)."""
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = self.logprobs
        return self

    prompt: (
        NonEmptyText
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[list[TokenId]], Field(min_length=1, max_length=MAX_PROMPTS)]
    )


class ContentPart(BaseModel):
    """One part of a message's content; only text parts carry text (others, such as images,
    are accepted and read as empty)."""

    type: StrictStr = "text"
    text: Text = ""


class ChatMessage(BaseModel):
    # any role the chat template may know, as vLLM accepts ("system", "user", "assistant",
    # "tool", "developer" have a meaning here); a word, so no role can forge template markup
    role: Annotated[StrictStr, Field(pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")]
    content: Text | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls (app/api/tools.py)
    tool_call_id: StrictStr | None = None  # a tool message: the call it answers

    def template_role(self) -> str:
        """The role the chat template sees: a ``developer`` message is a system one, as vLLM
        renders it (SmolLM2's template would otherwise add its default system prompt too)."""
        return "system" if self.role == "developer" else self.role

    def text(self) -> str:
        return joined_text(self.content)


class ChatCompletionRequest(OpenAIParams):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    tool_choice: ToolChoiceField | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = None

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
