"""The one exception type for model problems (missing, corrupt, unsupported)."""


class ModelError(Exception):
    """A model could not be found, read, converted or loaded.

    Every message names the file or directory at fault, so a user can act on it
    without a traceback.
    """
