"""The error of a bad setting, shared by the config loader and verl's key table."""


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key."""
