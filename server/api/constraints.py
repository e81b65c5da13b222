"""The grammar a chat or completion request's output must follow, if any.

tool_choice "required" or a named function: one call (or several, with
parallel_tool_calls, where the format's answer can hold several) in the model's own tool-call
format (`ToolFormat.grammar_tags` / `grammar_layout`); a format whose arguments are not one
JSON object cannot be constrained (a 400). Otherwise `response_format`
json_object / json_schema. The grammar engine (server/engine/structured/grammar.py) compiles it; the
engine masks each logits row with it (server/engine/decoding/logits_processors.py). Every offered
tool's `parameters` must be an object schema, whatever tool_choice (a 400 naming the
function otherwise).
"""
from __future__ import annotations

from lockstep.server.api.chat_protocol import ChatCompletionRequest

from lockstep.server.api.sampling_protocol import SamplingRequest
from lockstep.server.api.errors import APIError
from lockstep.server.api.tool_calls import ToolFormat


class Constraints:
    """Which grammar a request needs, compiled by the process's compiler for the model."""

    def __init__(self, loaded, tool_format: ToolFormat):
        self.loaded, self.tool_format = loaded, tool_format

    def _grammars(self):
        from lockstep.server.engine.structured.grammar import compiler_for  # built at first use, then shared

        return compiler_for(self.loaded)

    @staticmethod
    def needs_grammar(body: SamplingRequest) -> bool:
        """Whether `body`'s output is constrained: a forced tool call or a JSON response_format."""
        mode = body.tool_mode() if isinstance(body, ChatCompletionRequest) else "none"
        response_format = getattr(body, "response_format", None)
        return mode in ("required", "named") or (response_format is not None and response_format.type != "text")

    def grammar_for(self, body: SamplingRequest):
        """The compiled grammar `body` asks for, or None. Runs off the event loop, on the grammar
        checks' threads (server/api/grammar_checks.py: checking and compiling take milliseconds
        to seconds); an unsupported schema is a 400 naming the problem."""
        self.check_tools(body)
        if not self.needs_grammar(body):
            return None  # unconstrained: the grammar engine is not even imported
        mode = body.tool_mode() if isinstance(body, ChatCompletionRequest) else "none"
        response_format = getattr(body, "response_format", None)
        from lockstep.server.engine.structured.grammar import GrammarCheckerUnavailable, GrammarError

        param = "tools" if mode in ("required", "named") else "response_format"
        try:
            if mode in ("required", "named"):
                fmt = self.tool_format
                if not fmt.json_calls:
                    choice = "'required'" if mode == "required" else "naming a function"
                    raise APIError(400, f"tool_choice {choice} needs a tool-call format whose arguments are one "
                                        f"JSON object; this model's template uses {fmt.name!r} calls",
                                   param="tool_choice")
                start, end = fmt.grammar_tags()
                name = body.tool_choice.function.name if mode == "named" else None
                tools = [t.model_dump(exclude_none=True) for t in body.tools]
                # one call where the format's answer holds one (Llama 3.x, gpt-oss)
                parallel = body.parallel_tool_calls and name is None and fmt.max_calls != 1
                return self._grammars().tool_calls(tools, start=start, end=end, name=name, parallel=parallel,
                                                   layout=fmt.grammar_layout())
            if response_format.type == "json_object":
                return self._grammars().json_object()
            return self._grammars().json_schema(response_format.json_schema.schema_ or {})
        except GrammarError as exc:  # a limit's message names it, and its code says it is one
            raise APIError(400, str(exc), param=param, code=exc.code) from exc
        except GrammarCheckerUnavailable as exc:
            raise APIError(503, str(exc), type="server_error") from exc

    @staticmethod
    def check_tools(body: SamplingRequest) -> None:
        """Every tool's parameters are an object schema (OpenAI's rule), whatever tool_choice:
        a tool whose arguments could not be a JSON object could never be called."""
        from lockstep.server.engine.structured.grammar_limits import parameters_problem

        for tool in getattr(body, "tools", None) or []:
            problem = parameters_problem(tool.function.name, tool.function.parameters)
            if problem:
                raise APIError(400, f"tools: {problem}", param="tools")
