"""The exceptions a user of NanoInfer can cause, each naming the offending value."""


class NanoInferError(Exception):
    """Base class of every error NanoInfer raises on purpose."""


class CheckpointError(NanoInferError, ValueError):
    """A checkpoint cannot be used: a missing file, an unknown architecture, a truncated or
    corrupt safetensors/GGUF file, a tensor of the wrong shape. The message names the file
    and the problem."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")

    def __reduce__(self):  # (pickled as its arguments: a data-parallel replica's start-up error reaches the front)
        return type(self), (self.path, self.problem)


class ModelFetchError(NanoInferError, RuntimeError):
    """A named model could not be fetched into the local cache (no package index, no space)."""


class RequestError(NanoInferError, ValueError):
    """A request (prompt or sampling parameters) is invalid; the message names the value and
    the allowed range, and `param` the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None):
        self.param = param
        super().__init__(message)


class DeviceLost(NanoInferError, RuntimeError):
    """A device the engine runs on is gone (a tensor-parallel rank's process exited): nothing
    on it can run again; the engine fails every request and stops."""
