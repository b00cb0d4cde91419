"""`blaze systemone`: answer a SystemOne request (typed decisions) with a release's joint head."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from clef_model.errors import BlazeError
from variants.cli.options import load_runtime, runtime_options


def _read_requests(source: str) -> Any:
    """The parsed JSON of a request file (or stdin for -): one request object, or a list of them."""
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except OSError as error:
        raise BlazeError(f"cannot read {source} ({error.strerror}); pass a JSON request file or - for stdin.") from None
    except UnicodeDecodeError:
        raise BlazeError(f"{source} is not UTF-8 text; a request file is JSON in UTF-8.") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise BlazeError(f"{source} is not valid JSON ({error.msg} at line {error.lineno}); fix the request file.") from None
    except (ValueError, RecursionError) as error:  # an over-long integer; nesting deeper than Python's stack
        raise BlazeError(f"{source} cannot be read as a request ({type(error).__name__}: nesting too deep or a "
                         "number too long); fix the request file.") from None


@click.command("systemone")
@click.argument("ref")
@click.argument("request", metavar="REQUEST.json")
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(min=1),
              help="Requests per forward pass when the file holds a list of requests.")
@click.option("--indent", default=None, type=click.IntRange(min=0),
              help="Pretty-print the JSON with this indent (default: one line, like the API).")
@runtime_options
def systemone(ref: str, request: str, batch_size: int, indent: int | None, revision: str | None, device: str | None,
              trust_release_code: bool) -> None:
    """Answer a SystemOne request (JSON file, or - for stdin) with REF's joint head.

    Prints the response body exactly as the release's own `systemone` returns it. A file holding a
    JSON list of requests is answered in batches and printed as a list.
    """
    body = _read_requests(request)
    runtime = load_runtime(ref, revision, device, trust_release_code)
    response: list[dict[str, Any]] | dict[str, Any]
    try:
        if isinstance(body, list):
            response = runtime.systemone_batch(body, batch_size=batch_size)
        else:
            response = runtime.systemone(body)
    except ValueError as error:
        raise BlazeError(f"invalid SystemOne request: {error}") from None
    click.echo(json.dumps(response, ensure_ascii=False, indent=indent))
