"""The one exception type the model loaders raise for bad files and bad settings."""


class ModelFileError(ValueError):
    """A model or tokenizer file is unreadable, inconsistent or unsupported.

    Subclasses ValueError so callers that only know "bad input" still catch it. Messages
    always name the file and the tensor or key involved.
    """
