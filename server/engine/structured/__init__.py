"""Structured output: the grammar engine behind `GrammarCompiler`, the static limits checked
before it sees a schema, and the sandboxed checker for untrusted grammars."""
