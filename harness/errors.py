"""Errors the harness reports to a person, each saying what is wrong and how to fix it."""


class ConfigError(ValueError):
    """A flag combination that cannot run; the message says which and how to fix it."""
