"""The one exception type port raises for bad input."""


class PortError(Exception):
    """A problem with the user's input: one line naming the file, key or flag and what is wrong."""
