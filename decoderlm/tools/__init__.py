"""Tools and structured output: tool-call parsers, tool prompts for chat templates, grammar-constrained decoding."""

from decoderlm.tools.parsers import CallDelta, ParsedDelta, ToolCall, ToolParser, get_parser, parser_name_for

__all__ = ["CallDelta", "ParsedDelta", "ToolCall", "ToolParser", "get_parser", "parser_name_for"]
