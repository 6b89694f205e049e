"""The error of a bad setting, raised by the config loader, verl's key table and whatever reads
a setting (a folder a key names, a function a key names)."""


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key."""
