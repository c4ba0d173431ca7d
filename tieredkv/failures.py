"""Every failure cause tieredkv reports (a vLLM-free module, so tools import it cheaply).

Disk read causes come from :class:`tieredkv.disk.errors.FailureKind`; ``copy_error`` is a
failed device copy, ``cancelled`` a job fenced or shut down, ``injected`` a test fault, and
``unknown`` anything a job reported without a cause.
"""

FAILURE_CAUSES: tuple[str, ...] = (
    "io_error", "short_read", "checksum", "wrong_key", "missing", "timeout",
    "no_space", "wrong_namespace", "copy_error", "cancelled", "injected", "unknown",
)
