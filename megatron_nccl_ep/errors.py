"""The library's exception types, below every module that raises them."""


class NcclEpError(RuntimeError):
    """A runtime failure: device-side timeout, capacity overflow, transport error, a peer that
    did not take part in a collective step within the group's timeout."""
