"""The one exception for bad input: a config value, a file, a workdir, a task vector.

Its message names what is wrong (the config key, the file, the pytree path) and how to fix it.
The launch jobs print it as a single line and exit non-zero; any other exception is a bug and
keeps its traceback. It is a ValueError, so callers that catch those still do.
"""


class UserError(ValueError):
  """Bad input, named in the message."""
