"""Structured outputs and tool calling, protocol-neutral (no HTTP in here).

- ``constraint``: ``Constraint``, what a request's output must match (a JSON schema, any JSON
  object, a regex, a choice of strings, a Lark/GBNF grammar), and ``ConstraintError``.
- ``grammar``: ``GrammarCompiler`` (one per tokenizer) compiles a constraint with llguidance into
  a ``GrammarMatcher``, the per-request token mask state the engine drives.
- ``vocab``: the grammar engine's view of a tokenizer (the mocks' bytes, a checkpoint's BPE).
- ``tools``: ``ToolSpec``/``ToolChoice``, the constraint a tool choice implies, the default
  tool-call text format and its parser.

The API adapters (OpenAI chat/completions, and later Responses and Anthropic Messages) build
these objects from their own request shapes; the engine sees only ``TokenConstraint``.
"""
