"""User-facing errors: each message says what was wrong and what to do."""


class BlazeError(Exception):
    """An error caused by input or environment; the CLI prints it and exits with code 2."""


class ReleaseError(BlazeError):
    """A release could not be resolved, is incomplete, or does not fit what was asked of it."""


class RequestError(BlazeError, ValueError):
    """A SystemOne request that the release would refuse or choke on; the message names the field.

    A ValueError too, so code written against the release's own `systemone` (which raises ValueError)
    keeps working; a BlazeError, so the CLI reports it as bad input (exit 2).
    """


class UntrustedCodeError(ReleaseError):
    """The release ships code whose SHA-256 is not on blaze's allowlist and no opt-in was given."""
