"""The one exception type for mistakes a user can make (bad input, missing files, bad flags)."""


class DecoderLMError(Exception):
    """A user-facing error: the message names the problem and the fix, in one line."""
