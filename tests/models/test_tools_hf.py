"""A checkpoint whose chat template renders tools gets them (and earlier calls and tool
results) through the template; one without gets, as vLLM, the turns as they are (or the default
format with ``--tool-prompt-fallback describe``). The grammar engine reads a checkpoint's BPE
vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hf_tiny import save_tokenizer

from app.api.schemas import ChatMessage
from app.api.tools import ToolPlan, chat_prompt
from app.models.hf.tokenizer import HFTokenizer
from app.structured.constraint import Constraint
from app.structured.grammar import GrammarCompiler, allowed
from app.structured.tools import ToolChoice, ToolMode, ToolSpec

TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}CALL {{ c['function']['name'] }} "
    "{{ c['function']['arguments']['city'] }}{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PLAN = ToolPlan([ToolSpec("get_weather")], ToolChoice(ToolMode.AUTO), True)
CALL = {"name": "get_weather", "arguments": '{"city": "Rome"}'}
MESSAGES = [
    ChatMessage(role="user", content="Weather in Rome?"),
    ChatMessage.model_validate(
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": CALL}]}
    ),
    ChatMessage(role="tool", content="sunny", tool_call_id="c1"),
]


def _tokenizer(folder: Path, template: str | None) -> HFTokenizer:
    tok = save_tokenizer(folder)
    if template is not None:
        tok.chat_template = template
    return HFTokenizer(tok, vocab_size=len(tok), stop_token_ids=frozenset({2}), eos_token_id=2)


def _prompt(tokenizer: HFTokenizer, fallback: str = "none") -> str:
    settings = SimpleNamespace(tool_prompt_fallback=fallback)
    serving: Any = SimpleNamespace(tokenizer=tokenizer, settings=settings)
    return tokenizer.decode(chat_prompt(MESSAGES, PLAN, serving))


def test_a_template_that_renders_tools_gets_them(tmp_path: Path) -> None:
    tokenizer = _tokenizer(tmp_path, TOOLS_TEMPLATE)
    assert tokenizer.supports_tools
    text = _prompt(tokenizer)
    assert "TOOLS: get_weather" in text and "CALL get_weather Rome" in text and "sunny" in text


def test_a_template_without_tools_gets_the_turns_as_vllm_sends_them(tmp_path: Path) -> None:
    tokenizer = _tokenizer(tmp_path, None)
    assert not tokenizer.supports_tools
    plain = tokenizer.decode(
        tokenizer.chat_prompt([("user", "Weather in Rome?"), ("assistant", ""), ("tool", "sunny")])
    )
    assert _prompt(tokenizer) == plain  # no tool described, the call not shown
    assert "get_weather" not in plain


def test_describe_gives_a_template_without_tools_the_default_format(tmp_path: Path) -> None:
    tokenizer = _tokenizer(tmp_path, None)
    text = _prompt(tokenizer, "describe")
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_the_grammar_engine_masks_a_bpe_vocabulary(tmp_path: Path) -> None:
    tokenizer = _tokenizer(tmp_path, None)
    matcher = GrammarCompiler(tokenizer).matcher(Constraint.json_schema(
        {"type": "object", "properties": {"city": {"enum": ["Rome"]}}, "required": ["city"],
         "additionalProperties": False}))  # fmt: skip
    out: list[int] = []
    while not matcher.finished and len(out) < 40:
        mask = matcher.mask()
        token = next(t for t in range(tokenizer.vocab_size) if allowed(mask, t))
        assert matcher.accept(token)
        out.append(token)
    assert matcher.finished  # once nothing can follow, the grammar ends (with or without EOS)
    assert json.loads(tokenizer.decode([t for t in out if t != 2])) == {"city": "Rome"}
